"""The on-disk checkpoint format (version 1) and what save, load and export share.

One directory per checkpoint, `<checkpoint.dir>/step_<N>/`:

    manifest.json        what is where: step, world size, plan, model signature, every file
                         with its size and sha256, and every embedding rectangle
    shards_rank<r>.pt    rank r's embedding shards: per shard its table, row range, column
                         range, weight [rows, cols] and optimizer state (row-wise state
                         [rows], element-wise state [rows, cols], also for cols = 1)
    dense.pt             the dense state dict (`dense_state`: the model minus its embedding
                         storage), the dense optimizer's state dict, the
                         sparse optimizers' step count and RNG states

Every file holds data only (tensors, numbers, strings, lists, dicts) and is loaded that way
(`load_file`): a file holding anything else is refused, and the code in it never runs.

Embedding rows are stored as the rectangles each rank held, not as whole tables, so a save
never gathers a table on one rank. Replicated tables are saved once (by rank 0). A
directory without a complete manifest is never loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybridrec.sparse.api import EmbeddingModule, ShardView
from hybridrec.types import TableConfig, storage_tables

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
FILE_NAME = re.compile(r"^(dense|shards_rank\d+)\.pt$")  # the only files a manifest may list
CONVERT = "python -m hybridrec.train.checkpoint.convert"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or for a different model."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are missing, truncated or fail their checksum (not a mismatch
    with the model): an older checkpoint may still be intact."""


def dense_module(model: nn.Module) -> nn.Module:
    """The model's own module (inside DDP on several ranks): its state dict minus the
    embedding storage is the dense state (DLRM's keys as they have always been saved)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _storage_prefixes(module: nn.Module) -> tuple[str, ...]:
    return tuple(f"{n}." for n, m in module.named_modules() if isinstance(m, EmbeddingModule))


def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The dense state dict: dense_module's, minus the embedding storage (saved as shards)."""
    module = dense_module(model)
    skip = _storage_prefixes(module)
    return {k: v for k, v in module.state_dict().items() if not k.startswith(skip)}


def load_dense_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load `state` (as dense_state gives it) into the model's dense part, every key."""
    module = dense_module(model)
    skip = _storage_prefixes(module)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(skip)]
    if missing or unexpected:
        raise CheckpointError(
            f"dense state does not fit the model: missing {missing}, unexpected {unexpected}"
        )


def table_signature(tables: list[TableConfig]) -> list[dict[str, Any]]:
    """The tables' part of a model signature: name and shape of each, and a dynamic table's
    policy (`dynamic`: Dynamic's fields, what a resume may not change of it is checked
    against: checkpoint/dynamic.py); `tables` may be features (a table several share is one
    entry)."""
    out = []
    for t in storage_tables(tables):
        entry: dict[str, Any] = {"name": t.name, "num_rows": t.num_rows, "dim": t.dim}
        if t.dynamic is not None:
            entry["dynamic"] = dataclasses.asdict(t.dynamic)
        out.append(entry)
    return out


def model_signature(
    tables: list[TableConfig], model: nn.Module, sparse_opt: str, dense_opt: str
) -> dict[str, Any]:
    """What must match for a checkpoint to load: tables, dense shapes, optimizer kinds."""
    dense = dense_state(model)
    return {
        "tables": table_signature(tables),
        "dense": {k: list(v.shape) for k, v in dense.items()},
        "sparse_optimizer": sparse_opt,
        "dense_optimizer": dense_opt,
    }


def signature_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two model signatures (empty = compatible); a
    `current` without "dense" or an optimizer key leaves those out (checked before the
    model exists)."""
    diffs = []
    saved_t = {t["name"]: t for t in saved["tables"]}
    cur_t = {t["name"]: t for t in current["tables"]}
    for name in sorted(set(saved_t) | set(cur_t)):
        a, b = saved_t.get(name), cur_t.get(name)
        if a is None or b is None:
            diffs.append(
                f"table {name}: {'not in the checkpoint' if a is None else 'not in the model'}"
            )
        elif (a["num_rows"], a["dim"]) != (b["num_rows"], b["dim"]):
            diffs.append(
                f"table {name}: checkpoint {a['num_rows']}x{a['dim']}, "
                f"model {b['num_rows']}x{b['dim']}"
            )
    for key in sorted(set(saved["dense"]) | set(current["dense"])) if "dense" in current else []:
        a, b = saved["dense"].get(key), current["dense"].get(key)
        if a != b:
            diffs.append(f"dense {key}: checkpoint {a}, model {b}")
    for key in ("sparse_optimizer", "dense_optimizer"):
        if key in current and saved[key] != current[key]:
            diffs.append(f"{key}: checkpoint {saved[key]}, model {current[key]}")
    return diffs


def summarise(diffs: list[str], first: int = 4) -> str:
    """The first differences and how many of each kind are left (a 26-table model against a
    6-table one is not a 60-line list)."""
    shown = "; ".join(diffs[:first])
    rest = diffs[first:]
    if not rest:
        return shown
    kinds: dict[str, int] = {}
    for d in rest:
        kind = d.split(" ", 1)[0].rstrip(":")
        kinds[kind] = kinds.get(kind, 0) + 1
    names = {"dense": "dense tensor"}
    counts = ", ".join(f"{n} {names.get(k, k)}{'s' if n > 1 else ''}" for k, n in kinds.items())
    return f"{shown}; and {len(rest)} more ({counts})"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def write_file(obj: Any, path: Path) -> dict[str, Any]:
    """torch.save + fsync; returns the file's manifest entry."""
    with path.open("wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            # a write that fails inside torch.save (ENOSPC: a full disk) comes out as torch's
            # "unexpected pos N vs M" with the OSError only as context: report the OSError
            ctx = e.__context__
            if isinstance(ctx, OSError):
                raise OSError(ctx.errno, f"{ctx.strerror} (writing {path})") from e
            raise
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (by step)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "manifest.json").is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


@dataclass
class TrainState:
    """Everything besides weights that a resume needs."""

    step: int  # optimizer steps done
    data_position: int  # next global batch index of the training loader
    extra: dict[str, Any]


def sparse_step(modules: list[EmbeddingModule]) -> int | None:
    """The sparse optimizers' step count, the same in every embedding module holding rows on
    this rank; None when it holds none (a model's collections may all live on other ranks)."""
    counts = {m.sparse_step for m in modules if m.shard_views()}
    assert len(counts) <= 1, f"embedding modules disagree on their step count: {counts}"
    return counts.pop() if counts else None


def shard_views(modules: list[EmbeddingModule]) -> list[ShardView]:
    return [view for m in modules for view in m.shard_views()]


def replicated_tables(modules: list[EmbeddingModule]) -> set[str]:
    return {t for m in modules for t in m.replicated_tables()}
