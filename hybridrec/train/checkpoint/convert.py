"""`python -m hybridrec.train.checkpoint.convert --trust <checkpoint>`: rewrite a checkpoint
whose files hold pickled objects (written by an older hybridrec, or by hand) as data only.

Loading a checkpoint reads data only (hybridrec.safeload) and refuses such files, naming
this command. It is the one place that unpickles with `weights_only=False`, which runs
whatever code a file holds: it does nothing without `--trust` and names each file it
trusts before loading it. Each file that does not load as data is turned into tensors,
numbers, strings, lists and dicts (numpy arrays become tensors, numpy scalars numbers),
written beside it, checked to load as data and renamed over it; the manifest then gets
the new sizes and sha256 sums. Files that already load as data are left untouched.
`<checkpoint>` is one `step_<N>` directory or a checkpoint.dir (all its checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridrec.safeload import UnsafeFileError, load_tensors
from hybridrec.train.checkpoint.format import CheckpointError, list_checkpoints, write_file
from hybridrec.train.checkpoint.load import read_manifest

_ATOMS = (bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype, torch.device)


def plain(obj: Any, where: str) -> Any:
    """`obj` as data that torch.load(weights_only=True) reads; CheckpointError naming
    `where` (a path inside the file) for anything it cannot express."""
    if obj is None or isinstance(obj, _ATOMS):
        return obj
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            raise CheckpointError(f"{where}: a numpy object array cannot be converted")
        return torch.from_numpy(np.array(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            key = plain(k, f"{where} (a key)")
            out[key] = plain(v, f"{where}[{k!r}]")
        meta = getattr(obj, "_metadata", None)  # a module state dict's versions
        if isinstance(out, OrderedDict) and meta is not None:
            out._metadata = plain(meta, f"{where}._metadata")  # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)):  # torch.Size and named tuples become tuples
        items = [plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise CheckpointError(f"{where}: a {type(obj).__qualname__} cannot be converted to data")


def convert_checkpoint(path: Path, say: Any = print) -> list[str]:
    """Rewrite the files of checkpoint `path` that do not load as data; returns their names."""
    path = Path(path)
    manifest = read_manifest(path, verify=True)  # convert only what is intact
    converted = []
    for name in sorted(manifest["files"]):
        f = path / name
        try:
            load_tensors(f, mmap=True)
            continue
        except UnsafeFileError:
            pass
        say(f"trusting {f}: unpickling it runs any code it holds")
        obj = torch.load(f, map_location="cpu", weights_only=False)
        tmp = f.with_name(f.name + ".tmp")
        try:
            entry = write_file(plain(obj, str(f)), tmp)
            load_tensors(tmp)
            os.replace(tmp, f)
        finally:
            tmp.unlink(missing_ok=True)
        manifest["files"][name] = entry
        converted.append(name)
    if converted:
        tmp = path / "manifest.json.tmp"
        with tmp.open("w") as out:
            json.dump(manifest, out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path / "manifest.json")
    return converted


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hybridrec.train.checkpoint.convert", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("checkpoint", type=Path, help="a checkpoint (…/step_N) or a checkpoint.dir")
    p.add_argument(
        "--trust",
        action="store_true",
        help="you wrote these files: unpickling them runs any code they hold",
    )
    args = p.parse_args(argv)
    prog = "hybridrec-convert"
    path = args.checkpoint
    paths = [path] if (path / "manifest.json").is_file() else list_checkpoints(path)
    if not paths:
        print(f"{prog}: no complete checkpoint at {path}", file=sys.stderr)
        return 2
    if not args.trust:
        print(
            f"{prog}: converting unpickles {path}'s files, which runs any code they hold; "
            "only for checkpoints you wrote: run again with --trust",
            file=sys.stderr,
        )
        return 2
    try:
        for ck in paths:
            done = convert_checkpoint(ck, lambda line: print(f"{prog}: {line}", file=sys.stderr))
            print(f"{ck}: {'converted ' + ', '.join(done) if done else 'already data only'}")
    except (CheckpointError, OSError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
