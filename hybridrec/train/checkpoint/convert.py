"""`python -m hybridrec.train.checkpoint.convert <checkpoint>`: rewrite a checkpoint whose
files hold numpy data (written by an older hybridrec, or by hand) as tensors and plain data,
or are in torch's legacy (pre-1.6) format, as its zip format.

Loading a checkpoint reads data only (hybridrec.safeload) and refuses such files, naming
this command. The conversion reads them with one allowlist more, numpy's arrays, scalars
and dtypes (safeload.load_convertible), and builds nothing else: a file naming any other
global (a pickled callable such as os.system, an unknown class) is refused with the
globals listed and the newest intact checkpoint named, and nothing in it runs. Each
convertible file becomes tensors, numbers, strings, lists and dicts (numpy arrays become
tensors, numpy scalars numbers), is written beside it, checked to load as data and renamed
over it; the manifest then gets the new sizes and sha256 sums. A legacy-format file of data
is rewritten the same way (it loads, but cannot be memory-mapped). A file torch.save did not
write (a plain pickle) is refused, as is one torch cannot parse. Files that already load as
data in the zip format are left untouched. `<checkpoint>` is one `step_<N>` directory or a
checkpoint.dir (all its checkpoints). `--trust`, which older versions required because they
unpickled in full, is accepted and changes nothing. Exit status: 0 converted (or nothing to
do), 2 no checkpoint at the path, 1 a file refused or not convertible.
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

from hybridrec.safeload import UnsafeFileError, load_convertible, load_tensors, torch_format
from hybridrec.train.checkpoint.format import (
    CheckpointError,
    CorruptCheckpointError,
    list_checkpoints,
    write_file,
)
from hybridrec.train.checkpoint.load import UNREADABLE, first_sentence, read_manifest, refusal

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
    """Rewrite the files of checkpoint `path` that hold numpy data; returns their names.
    CheckpointError (one line, see format.refusal) for a file holding anything else."""
    path = Path(path)
    manifest = read_manifest(path, verify=True)  # convert only what is intact
    converted = []
    for name in sorted(manifest["files"]):
        f = path / name
        zipped = torch_format(f) == "zip"
        try:
            obj = load_tensors(f, mmap=zipped)
            if zipped:
                continue
            say(f"converting {f}: torch's legacy format -> its zip format (memory-mapped loads)")
        except UnsafeFileError as e:
            if not e.convertible:
                raise CheckpointError(refusal(e, path)) from None
            say(f"converting {f}: numpy data -> tensors and numbers")
            try:
                obj = load_convertible(f)
            except UnsafeFileError as e:
                raise CheckpointError(refusal(e, path)) from None
        except UNREADABLE as e:
            raise CorruptCheckpointError(
                f"checkpoint file {f} cannot be read as a torch.save file (truncated or damaged): "
                f"{type(e).__name__}: {first_sentence(e)}; nothing was converted"
            ) from None
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
    p.add_argument("--trust", action="store_true", help=argparse.SUPPRESS)  # older versions'
    args = p.parse_args(argv)
    prog = "hybridrec-convert"
    path = args.checkpoint
    paths = [path] if (path / "manifest.json").is_file() else list_checkpoints(path)
    if not paths:
        print(f"{prog}: no complete checkpoint at {path}", file=sys.stderr)
        return 2
    try:
        for ck in paths:
            done = convert_checkpoint(ck, lambda line: print(f"{prog}: {line}", file=sys.stderr))
            print(f"{ck}: {'converted ' + ', '.join(done) if done else 'already data only'}")
    except (CheckpointError, OSError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
