"""`hybridrec-export <checkpoint> <file>`: one file with the full model state dict.

Names: `embeddings.<table>.weight` [rows, dim] for every table (reassembled from whatever
shards the checkpoint holds) and the dense modules by module path (`dense.bottom.0.weight`,
`dense.top.4.bias`, ...), and `model_config` (the model section of the config, JSON).
Score with it: `hybridrec.model.load_export(<file>)` gives a plain PyTorch module; or
warm-start a run with `model.init_from=<file>`. Needs host memory for the whole model.

`--retrieval` (a model.task=retrieval model) also writes the catalogue for serving:
`retrieval.item_ids` [N] (every item id of the dataset, any split, ascending: the items the
trainer's evaluation ranks; with the spec's `encoding: identity` these are the raw ids) and
`retrieval.item_vectors` [N, D] (the item tower's outputs), next to both towers' weights.
The dataset is `--data DIR`, else the one the checkpoint was trained on (its data.path).
load_export then answers `topk(dense, ids, k, exclude)`; docs/training.md shows the vectors in
an ANN index.

Exit status: 0 written, 2 no complete checkpoint at the path given, 1 a checkpoint that
cannot be exported (a damaged or refused file, a model config that load_export would
refuse, an output that cannot be written, --retrieval without a retrieval model or its
data), with one line `hybridrec-export: <message>`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from hybridrec.data.dataset import open_dataset
from hybridrec.data.interactions import SPLITS
from hybridrec.inference import ITEM_IDS, ITEM_VECTORS, RetrievalExport, load_export
from hybridrec.safeload import load_tensors
from hybridrec.train.checkpoint import (
    CheckpointError,
    export_checkpoint,
    list_checkpoints,
    read_manifest,
)
from hybridrec.train.checkpoint.format import write_file
from hybridrec.types import hot_offsets


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hybridrec-export", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "checkpoint",
        type=Path,
        help="a checkpoint (…/step_N) or a checkpoint.dir (its newest one is used)",
    )
    p.add_argument("file", type=Path, help="output file (torch.save format)")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 checks")
    p.add_argument(
        "--retrieval",
        action="store_true",
        help="also write every item's vector (a model.task=retrieval model), for serving",
    )
    p.add_argument(
        "--data",
        type=Path,
        help="with --retrieval: the dataset whose items are the catalogue (default: the "
        "checkpoint's data.path)",
    )
    args = p.parse_args(argv)
    path = args.checkpoint
    if not (path / "manifest.json").is_file():
        found = list_checkpoints(path)
        if not found:
            print(f"hybridrec-export: no complete checkpoint at {path}", file=sys.stderr)
            return 2
        path = found[-1]
    extra = read_manifest(path, verify=False).get("extra", {})
    try:
        shapes = export_checkpoint(path, args.file, verify=not args.no_verify)
        if args.retrieval:
            data = args.data or (extra.get("stream") or {}).get("data.path")
            items = write_catalogue(args.file, data)
    except (CheckpointError, ValueError) as e:  # refused files or config, damaged files
        print(f"hybridrec-export: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. the output cannot be written: read-only, full, not a directory
        print(f"hybridrec-export: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    n = sum(1 for k in shapes if k.startswith("embeddings."))
    print(f"wrote {args.file}: {n} tables and {len(shapes) - n} dense tensors from {path}")
    if args.retrieval:
        print(f"and the vectors of {items} items, every item of the dataset {data}")
    model = extra.get("model")
    target = model.get("_target_") if isinstance(model, dict) else None
    trust = ", trust_import=True" if target else ""  # the class is imported: the user's call
    use = "topk(dense, ids, k, exclude)" if args.retrieval else "predict(dense, ids)"
    print(f"score with: hybridrec.model.load_export({str(args.file)!r}{trust}).{use}")
    return 0


def write_catalogue(file: Path, data: str | Path | None) -> int:
    """Add the catalogue's item ids and vectors to the export `file` (rewritten atomically);
    returns the number of items. ValueError (one line) for a model that is not a retrieval
    model or a dataset that is missing."""
    model = load_export(file, trust_import=True)  # export_checkpoint checked the class
    if not isinstance(model, RetrievalExport):
        raise ValueError(
            f"--retrieval exports a model.task=retrieval model; this one is {model.cfg.task}"
        )
    if not data or not (Path(data) / "manifest.json").is_file():
        raise ValueError(
            f"--retrieval needs the dataset whose items are the catalogue: --data DIR (the "
            f"checkpoint names {data!r}, which holds no dataset)"
        )
    ds = open_dataset(data)
    names = [t.name for t in model.tables]
    column = hot_offsets(model.tables)[names.index(model.item_feature)]
    rows = model.tables[names.index(model.item_feature)].num_rows
    present = np.zeros(rows, dtype=bool)
    for split in SPLITS:  # the catalogue the trainer evaluates (Interactions.catalogue)
        lo, hi = ds.manifest.splits.get(split, (0, 0))
        for a in range(lo, hi, 1 << 20):
            ids = np.asarray(ds.categorical[a : min(a + (1 << 20), hi), column], np.int64)
            present[ids] = True
    items = torch.from_numpy(np.flatnonzero(present).astype(np.int64))
    state = load_tensors(file)
    state[ITEM_IDS], state[ITEM_VECTORS] = items, model.candidates(items)
    tmp = file.with_name(file.name + ".tmp")
    try:
        write_file(state, tmp)
        os.replace(tmp, file)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return len(items)


if __name__ == "__main__":
    sys.exit(main())
