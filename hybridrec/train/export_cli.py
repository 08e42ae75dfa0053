"""`hybridrec-export <checkpoint> <file>`: one file with the full model state dict.

Names: `embeddings.<table>.weight` [rows, dim] for every table (reassembled from whatever
shards the checkpoint holds) and the dense modules by module path (`dense.bottom.0.weight`,
`dense.top.4.bias`, ...), and `model_config` (the model section of the config, JSON).
Score with it: `hybridrec.model.load_export(<file>)` gives a plain PyTorch module; or
warm-start a run with `model.init_from=<file>`. Needs host memory for the whole model.

A model of your own class (`model._target_`) needs `--model pkg.module.Class`, the class it
was trained with: nothing a checkpoint names is imported, the manifest's `_target_` is only
compared with it (a mismatch is refused naming both). Built-in models need no flag.

The dataset the model was trained on (`--data DIR`, else the checkpoint's data.path when it
holds one) is recorded (hybridrec.serving): its dense transforms, so `predict`, `query` and
`topk` take raw values with `raw=True`, and which rows its train split holds, so `topk`
refuses (or flags) rows whose ids were never trained. A dataset other than the model's is
refused, naming it.

`--retrieval` (a model.task=retrieval model) also writes the catalogue for serving:
`retrieval.item_ids` [N] (every item id of the dataset, any split, ascending: the items the
trainer's evaluation ranks; with the spec's `encoding: identity` these are the raw ids) and
`retrieval.item_vectors` [N, D] (the item tower's outputs), next to both towers' weights.
load_export then answers `topk(dense, ids, k, exclude)`; docs/training.md shows the vectors in
an ANN index.

A model.task=next_item checkpoint (data=sequences: model=sasrec, model=hstu) is always written
with its catalogue, no flag needed (`--retrieval` changes nothing; `--data` is refused: the
export reads no dataset): `retrieval.item_ids` [N] and `retrieval.item_vectors` [N, D] for
every row of the item table (the catalogue the trainer's evaluation ranks), the ids as the
data file numbers items (the `user item` format's 1-based ids; an interaction table's
`data.sequence.item_base` + row), from the data settings the checkpoint records.
load_export then answers `topk(histories, k)` (hybridrec.next_item_serving; docs/sequences.md).

Exit status: 0 written; 2 a usage error: no complete checkpoint at the path given, --data
holding no dataset or another one than the model's (or given for a next-item checkpoint), a
`_target_` model without --model or with another class; 1 a checkpoint that cannot be
exported (a damaged or refused file, a model config that load_export would refuse, an output
that cannot be written, --retrieval without a retrieval model or its data, a next-item
checkpoint that does not record its data settings), with one line `hybridrec-export:
<message>`.
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
from hybridrec.data.sequence_source import FORMATS, item_id_base
from hybridrec.inference import (
    ITEM_IDS,
    ITEM_VECTORS,
    NextItemExport,
    RetrievalExport,
    load_export,
)
from hybridrec.safeload import load_tensors
from hybridrec.train.checkpoint import (
    CheckpointError,
    export_checkpoint,
    list_checkpoints,
    read_manifest,
)
from hybridrec.train.checkpoint.export import NamedClassError
from hybridrec.train.checkpoint.format import write_file
from hybridrec.types import hot_offsets


class UsageError(ValueError):
    """An argument that names the wrong thing (--data, --model): exit status 2."""


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
        "--model",
        help="the class a model._target_ checkpoint was trained with (pkg.module.Class): "
        "nothing a checkpoint names is imported; a built-in model needs none",
    )
    p.add_argument(
        "--retrieval",
        action="store_true",
        help="also write every item's vector (a model.task=retrieval model), for serving",
    )
    p.add_argument(
        "--data",
        type=Path,
        help="the dataset the model was trained on (default: the checkpoint's data.path): "
        "its dense transforms and trained rows are recorded, and with --retrieval its items "
        "are the catalogue",
    )
    args = p.parse_args(argv)
    path = args.checkpoint
    if not (path / "manifest.json").is_file():
        found = list_checkpoints(path)
        if not found:
            print(f"hybridrec-export: no complete checkpoint at {path}", file=sys.stderr)
            return 2
        path = found[-1]
    try:
        extra = read_manifest(path, verify=False).get("extra", {})
        model_cfg = extra.get("model")  # checked by export_checkpoint: maybe not a dict here
        next_item = isinstance(model_cfg, dict) and model_cfg.get("task") == "next_item"
        base = next_item_base(args.data, extra, path) if next_item else None
        data = None if next_item else dataset_of(args.data, extra, args.retrieval)
        try:
            shapes = export_checkpoint(path, args.file, not args.no_verify, args.model, data)
        except ValueError as e:  # the dataset does not fit the model
            raise (UsageError(str(e)) if args.data else e) from None
        if base is not None:
            items = write_next_item_catalogue(args.file, base, args.model)
        elif args.retrieval:
            items = write_catalogue(args.file, data, args.model)
    except (UsageError, NamedClassError) as e:
        print(f"hybridrec-export: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, ValueError) as e:  # refused files or config, damaged files
        print(f"hybridrec-export: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. the output cannot be written: read-only, full, not a directory
        print(f"hybridrec-export: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    n = sum(1 for k in shapes if k.startswith("embeddings.") and k.endswith(".weight"))
    dense = sum(1 for k in shapes if k.startswith("dense."))
    print(f"wrote {args.file}: {n} tables and {dense} dense tensors from {path}")
    named = f", model={args.model!r}" if args.model else ""
    if base is not None:
        print(
            f"and the vectors of {items} items, every row of the item table (item ids {base}.."
            f"{base + items - 1}, as the data file numbers them)"
        )
        load = f"hybridrec.model.load_export({str(args.file)!r}{named})"
        print(f"serve with: {load}.topk(histories, k)")
        return 0
    if data is not None:
        print(f"recorded the dataset {data}: its dense transforms, the ids its train split holds")
    else:
        print(
            "no dataset recorded (the checkpoint names none that exists; give it with --data "
            "DIR): predict(..., raw=True) and topk's checks of untrained rows need it"
        )
    if args.retrieval:
        print(f"and the vectors of {items} items, every item of the dataset {data}")
    use = "topk(dense, ids, k, exclude)" if args.retrieval else "predict(dense, ids)"
    print(f"score with: hybridrec.model.load_export({str(args.file)!r}{named}).{use}")
    return 0


def dataset_of(given: Path | None, extra: dict, retrieval: bool) -> Path | None:
    """The dataset to record: --data (UsageError when it holds none), else the checkpoint's
    data.path when it holds one (ValueError for --retrieval, which needs it), else None."""
    if given is not None:
        if not (given / "manifest.json").is_file():
            lead = "--retrieval needs the dataset whose items are the catalogue: " * retrieval
            raise UsageError(
                f"{lead}--data {given} holds no dataset (no manifest.json there); give the "
                "preprocessed dataset the model was trained on"
            )
        return given
    saved = (extra.get("stream") or {}).get("data.path")
    if saved and (Path(saved) / "manifest.json").is_file():
        return Path(saved)
    if retrieval:
        raise ValueError(
            "--retrieval needs the dataset whose items are the catalogue: the checkpoint's "
            f"data.path {saved!r} holds no dataset; give it with --data DIR"
        )
    return None


def write_catalogue(file: Path, data: Path, model_class: str | None) -> int:
    """Add the catalogue's item ids and vectors to the export `file` (rewritten atomically);
    returns the number of items. ValueError (one line) for a model that is not a retrieval
    model. `data` fits the model: export_checkpoint checked it (record_dataset)."""
    model = load_export(file, model=model_class)  # export_checkpoint checked the class
    if not isinstance(model, RetrievalExport):
        raise ValueError(
            f"--retrieval exports a model.task=retrieval model; this one is {model.cfg.task}"
        )
    ds = open_dataset(data)
    names = [t.name for t in model.tables]
    column = hot_offsets(model.tables)[names.index(model.item_feature)]
    seen = []
    for split in SPLITS:  # the catalogue the trainer evaluates (Interactions.catalogue)
        lo, hi = ds.manifest.splits.get(split, (0, 0))
        for a in range(lo, hi, 1 << 20):
            ids = np.asarray(ds.categorical[a : min(a + (1 << 20), hi), column], np.int64)
            seen.append(np.unique(ids))  # any int64 id (a dynamic table's raw ones too)
    items = torch.from_numpy(np.unique(np.concatenate(seen or [np.empty(0, np.int64)])))
    add_entries(file, {ITEM_IDS: items, ITEM_VECTORS: model.candidates(items)})
    return len(items)


def next_item_base(given: Path | None, extra: dict, path: Path) -> int:
    """The data file's id of item row 0 for a next-item checkpoint's export (module
    docstring), from the data settings `extra` (its manifest's) records. UsageError for
    --data (such an export reads no dataset), ValueError when the settings are not there."""
    if given is not None:
        raise UsageError(
            f"--data {given}: a next-item export reads no dataset (its catalogue is the item "
            "table's rows, its item ids from the checkpoint's data settings); drop --data"
        )
    stream = extra.get("stream")
    seq = stream.get("data.sequence") if isinstance(stream, dict) else None
    if not isinstance(seq, dict) or not isinstance(stream.get("data.path"), str):
        raise ValueError(
            f"checkpoint {path} does not record its data.sequence settings (saved before "
            "hybridrec recorded them), so how its data numbers items is unknown; export a "
            "checkpoint saved by this version of hybridrec"
        )
    fmt, item_base = seq.get("format", "auto"), seq.get("item_base", 0)
    if fmt not in FORMATS or not isinstance(item_base, int) or isinstance(item_base, bool):
        raise ValueError(
            f"checkpoint {path}: its manifest's data.sequence format {fmt!r} and item_base "
            f"{item_base!r} are not one of {list(FORMATS)} and an integer (a hand-edited "
            "manifest? export the checkpoint training wrote)"
        )
    return item_id_base(stream["data.path"], fmt, item_base)


@torch.no_grad()
def write_next_item_catalogue(
    file: Path, base: int, model_class: str | None, chunk: int = 65536
) -> int:
    """Add every item row's vector to the export `file` of a next-item model, with the ids
    base + row (module docstring); returns the number of items."""
    model = load_export(file, model=model_class)  # export_checkpoint checked the class
    assert isinstance(model, NextItemExport), "a model.task=next_item checkpoint"
    rows = model.tables[model.names.index("seq")].num_rows
    vectors = torch.cat(
        [
            model.net.candidates(torch.arange(a, min(a + chunk, rows))).float()
            for a in range(0, rows, chunk)
        ]
    )
    add_entries(file, {ITEM_IDS: torch.arange(rows) + base, ITEM_VECTORS: vectors})
    return rows


def add_entries(file: Path, entries: dict[str, torch.Tensor]) -> None:
    """`entries` added to the export `file`, rewritten atomically (no half-written file)."""
    state = load_tensors(file)
    state.update(entries)
    tmp = file.with_name(file.name + ".tmp")
    try:
        write_file(state, tmp)
        os.replace(tmp, file)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


if __name__ == "__main__":
    sys.exit(main())
