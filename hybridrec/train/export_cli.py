"""`hybridrec-export <checkpoint> <file>`: one file with the full model state dict.

Names: `embeddings.<table>.weight` [rows, dim] for every table (reassembled from whatever
shards the checkpoint holds) and the dense modules by module path (`dense.bottom.0.weight`,
`dense.top.4.bias`, ...), and `model_config` (the model section of the config, JSON).
Score with it: `hybridrec.model.load_export(<file>)` gives a plain PyTorch module; or
warm-start a run with `model.init_from=<file>`. Needs host memory for the whole model.
Exit status: 0 written, 2 no complete checkpoint at the path given, 1 a checkpoint that
cannot be exported (a damaged or refused file, a model config that load_export would
refuse, an output that cannot be written), with one line `hybridrec-export: <message>`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hybridrec.train.checkpoint import (
    CheckpointError,
    export_checkpoint,
    list_checkpoints,
    read_manifest,
)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hybridrec-export", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "checkpoint",
        type=Path,
        help="a checkpoint (…/step_N) or a checkpoint.dir (its newest one is used)",
    )
    p.add_argument("file", type=Path, help="output file (torch.save format)")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 checks")
    args = p.parse_args(argv)
    path = args.checkpoint
    if not (path / "manifest.json").is_file():
        found = list_checkpoints(path)
        if not found:
            print(f"hybridrec-export: no complete checkpoint at {path}", file=sys.stderr)
            return 2
        path = found[-1]
    try:
        shapes = export_checkpoint(path, args.file, verify=not args.no_verify)
    except CheckpointError as e:  # a file or the model config refused, damaged files
        print(f"hybridrec-export: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. the output cannot be written: read-only, full, not a directory
        print(f"hybridrec-export: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    n = sum(1 for k in shapes if k.startswith("embeddings."))
    print(f"wrote {args.file}: {n} tables and {len(shapes) - n} dense tensors from {path}")
    model = read_manifest(path, verify=False).get("extra", {}).get("model")
    target = model.get("_target_") if isinstance(model, dict) else None
    trust = ", trust_import=True" if target else ""  # the class is imported: the user's call
    print(f"score with: hybridrec.model.load_export({str(args.file)!r}{trust}).predict(dense, ids)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
