"""A checkpoint as one file with the full model (`hybridrec-export`), and warm starts from
such a file (`model.init_from`). The file is a flat state dict: `embeddings.<table>.weight`
[rows, dim], `dense.<module path>` and `model_config` (JSON, checked before it is copied
from the manifest: `checked_model_config`), and what it records of its dataset
(hybridrec.serving: `data.dense_transforms`, `data.trained.<feature>`); no optimizer state.
Files are read as data only: one holding anything else is refused, and its code never runs;
nothing a manifest names is imported (the user names a model's class).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridrec.config import ModelConfig
from hybridrec.inference import MODEL_CONFIG_KEY
from hybridrec.model.registry import check_model_config, model_config
from hybridrec.safeload import UnsafeFileError, load_tensors
from hybridrec.scoring import load_rows
from hybridrec.serving import record_dataset
from hybridrec.sparse.api import embedding_modules
from hybridrec.sparse.dynamic.check import slot_id_problem
from hybridrec.train.checkpoint.format import (
    CheckpointError,
    CorruptCheckpointError,
    dense_state,
    load_dense_state,
    write_file,
)
from hybridrec.train.checkpoint.load import ShardFiles, load_dense, nonfinite_row, read_manifest
from hybridrec.types import TableConfig, storage_tables


def export_checkpoint(
    path: Path,
    out_file: Path,
    verify: bool = True,
    model: str | None = None,
    data: str | Path | None = None,
) -> dict[str, list[int]]:
    """One file with the full model state dict: `embeddings.<table>.weight` [rows, dim] and
    the dense modules by module path (`dense.bottom.0.weight`, ...). Returns name -> shape.
    `model`: the import path of the class a `model._target_` checkpoint was trained with,
    named by the user (`checked_model_config`; a built-in model needs none). `data`: the
    dataset it was trained on, whose dense transforms and trained rows the file records
    (hybridrec.serving.record_dataset; ValueError naming it when it does not fit)."""
    path = Path(path)
    manifest = read_manifest(path, verify)
    model_cfg = manifest.get("extra", {}).get("model")
    text, record = None, {}
    if model_cfg is not None:  # so hybridrec.model.load_export needs nothing else
        text = checked_model_config(path / "manifest.json", model_cfg, model)
        if data is not None:
            cfg = ModelConfig(**json.loads(text))
            record = record_dataset(data, cfg.tables(), cfg.num_dense_features)
    try:
        out = whole_tables(path, manifest)
    except CheckpointError:
        raise
    except (KeyError, TypeError, IndexError, ValueError, RuntimeError) as e:  # a hand-edited file
        raise CorruptCheckpointError(
            f"checkpoint {path}: its manifest and shard files do not agree ({type(e).__name__}: "
            f"{e}); export the checkpoint training wrote"
        ) from None
    dense = load_dense(path)
    out.update({f"dense.{k}": v for k, v in dense["model"].items()})
    if text is not None:
        out[MODEL_CONFIG_KEY] = text  # type: ignore[assignment]
    out.update(record)
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(out_file.name + ".tmp")
    try:
        write_file(out, tmp)
        os.replace(tmp, out_file)
    except OSError:
        tmp.unlink(missing_ok=True)  # no half-written file left beside the output
        raise
    return {k: list(v.shape) for k, v in out.items() if isinstance(v, torch.Tensor)}


def whole_tables(path: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every table of checkpoint `path` whole, from the rectangles its shards hold:
    `embeddings.<table>.weight` [rows, dim], and a dynamic table's map
    `embeddings.<table>.slot_id` [rows] (its shards' row-wise state dyn_slot_id)."""
    files = ShardFiles(path)
    out: dict[str, torch.Tensor] = {}
    for t in manifest["signature"]["tables"]:
        full = torch.empty(t["num_rows"], t["dim"])
        slot_id = None  # a dynamic table's map (its shards' row-wise state dyn_slot_id)
        covered = 0
        for s in (s for s in manifest["shards"] if s["table"] == t["name"]):
            (r0, r1), (c0, c1) = s["rows"], s["cols"]
            shard = files(s["file"])["shards"][s["index"]]
            full[r0:r1, c0:c1] = shard["weight"]
            if "dyn_slot_id" in shard["state"]:
                if slot_id is None:
                    slot_id = torch.full((t["num_rows"],), -1, dtype=torch.int64)
                slot_id[r0:r1] = shard["state"]["dyn_slot_id"]
            covered += (r1 - r0) * (c1 - c0)
        if covered != t["num_rows"] * t["dim"]:
            raise CheckpointError(f"checkpoint {path} does not cover table {t['name']}")
        out[f"embeddings.{t['name']}.weight"] = full
        if slot_id is not None:
            out[f"embeddings.{t['name']}.slot_id"] = slot_id
    return out


_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


class NamedClassError(CheckpointError):
    """The model class the user named (or did not name) does not fit the checkpoint's
    `_target_`: a usage error (hybridrec-export exits 2)."""


def checked_model_config(mf: Path, model_cfg: Any, model: str | None = None) -> str:
    """The manifest's model config as the JSON an export carries, checked as load_export
    checks it (model settings only, a registered arch, a task) and, for a `_target_`, as
    training checked it: an import path (pkg.module.Class, outside the standard library,
    which holds no model) equal to `model`, the class the user names, which must be an
    nn.Module class that takes model.args and declares the dataset's features (imported to
    check it: the user named it). What the manifest names is never imported: a `_target_`
    without `model`, a `model` that differs from it, or one for a built-in model is a
    NamedClassError naming both; anything else a CheckpointError naming the manifest."""
    text = json.dumps(model_cfg)
    try:
        cfg = model_config(mf, text, allow_target=True)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    target = cfg._target_
    if target is None:
        if model is not None:
            raise NamedClassError(
                f"--model {model}: {mf} holds the built-in model.arch={cfg.arch}, not a class "
                "of your own; drop --model"
            )
        return text
    if not isinstance(target, str) or not _IMPORT_PATH.fullmatch(target):
        raise CheckpointError(
            f"{mf}: model _target_={target!r} is not the import path of a model class "
            "(pkg.module.Class); refused"
        )
    if target.split(".")[0] in sys.stdlib_module_names:
        raise CheckpointError(
            f"{mf}: model _target_={target!r} names the standard library, not a model class; "
            "refused (a hand-edited manifest? export the checkpoint training wrote)"
        )
    if model is None:
        raise NamedClassError(
            f"{mf} was trained with model._target_={target}, a class of your own, and nothing "
            "a checkpoint names is imported: name the class you trained it with, "
            "hybridrec-export ... --model pkg.Class"
        )
    if model != target:
        raise NamedClassError(
            f"--model {model}, but {mf} was trained with model._target_={target}: name the "
            "class it was trained with"
        )
    try:
        check_model_config(cfg)
    except ValueError as e:
        raise CheckpointError(f"{mf}: {e}; refused") from None
    return text


def _rows_problem(state: dict[str, Any], t: TableConfig) -> str | None:
    """What is wrong with an export's rows of table `t` (its weight's shape is right): a
    non-finite row, or a dynamic table's slot ids that do not fit its policy (ids outside
    their rows' buckets, twice, in unknown rows, not int64 [rows]: sparse.dynamic.check)."""
    row = nonfinite_row(state[f"embeddings.{t.name}.weight"])
    if row is not None:
        return f"row {row} of its weight is not finite (NaN or inf)"
    slot_id = state.get(f"embeddings.{t.name}.slot_id")
    if t.dynamic is None or slot_id is None:
        return None
    if not isinstance(slot_id, torch.Tensor):
        return f"slot_id is a {type(slot_id).__name__}, not a tensor"
    return slot_id_problem(slot_id, t.dynamic, t.num_rows, 0, t.num_rows, "slot_id")


def init_from_export(file: Path, model: nn.Module, tables: list[TableConfig]) -> None:
    """Warm start: copy an exported state dict's weights into this rank's shards and dense
    part (optimizer state starts fresh). Shapes must match; differences are listed."""
    file = Path(file)
    if (file / "manifest.json").is_file():
        raise CheckpointError(
            f"model.init_from={str(file)!r} is a checkpoint directory, not an export: resume "
            f"from it with checkpoint.resume={file} (weights and optimizer state), or write an "
            f"export with `hybridrec-export {file} model.pt` and pass model.init_from=model.pt"
        )
    if not file.is_file():
        raise CheckpointError(f"model.init_from={str(file)!r}: no such file")
    try:
        state = load_tensors(file, mmap=True)
    except UnsafeFileError as e:
        raise CheckpointError(f"model.init_from={str(file)!r}: {e.reason}") from None
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise CheckpointError(
            f"model.init_from={str(file)!r}: cannot be read as a hybridrec-export file "
            f"(truncated or another format?): {type(e).__name__}: {e}"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"model.init_from={str(file)!r}: holds a {type(state).__name__}, not the state dict "
            "hybridrec-export writes"
        )
    diffs = []
    for t in storage_tables(tables):
        w = state.get(f"embeddings.{t.name}.weight")
        if w is None:
            diffs.append(f"embeddings.{t.name}.weight: missing from the file")
        elif list(w.shape) != [t.num_rows, t.dim]:
            diffs.append(
                f"embeddings.{t.name}.weight: file {list(w.shape)}, model {[t.num_rows, t.dim]}"
            )
        else:
            problem = _rows_problem(state, t)
            if problem:
                raise CheckpointError(
                    f"model.init_from={str(file)!r}: embeddings.{t.name}: {problem}; warm start "
                    "from an export of a table with this policy, or train the table anew"
                )
    saved = {k.removeprefix("dense."): v for k, v in state.items() if k.startswith("dense.")}
    mine = dense_state(model)
    for k, v in mine.items():
        if k not in saved:
            diffs.append(f"dense.{k}: missing from the file")
        elif saved[k].shape != v.shape:
            diffs.append(f"dense.{k}: file {list(saved[k].shape)}, model {list(v.shape)}")
    if diffs:
        raise CheckpointError(f"{file} does not fit this model:\n  " + "\n  ".join(diffs))
    load_rows(state, embedding_modules(model))  # a dynamic table keeps its ids' rows
    load_dense_state(model, {k: saved[k] for k in mine})
