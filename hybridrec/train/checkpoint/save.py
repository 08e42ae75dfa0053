"""Saving a checkpoint atomically from every rank, and checking the directory beforehand.

Every rank writes into `.step_<N>.tmp`, the ranks agree that all writes succeeded, then
rank 0 writes the manifest and renames the directory to `step_<N>` (a rename is atomic on
one filesystem; multi-node runs need a shared filesystem). A failure midway (a full disk)
leaves the previous checkpoints untouched, and every rank raises the same CheckpointError.
Old checkpoints are rotated out (`checkpoint.keep`). The directories it creates
(checkpoint.dir, each step_<N>) are owner-only (0o700): a checkpoint is as sensitive as
the model, and only its writer should be able to change it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridrec.distributed.comm import all_gather_object, any_rank
from hybridrec.distributed.env import DistEnv
from hybridrec.sparse.api import embedding_modules
from hybridrec.train.checkpoint.format import (
    FORMAT_VERSION,
    CheckpointError,
    TrainState,
    dense_state,
    list_checkpoints,
    replicated_tables,
    shard_views,
    sparse_step,
    write_file,
)
from hybridrec.types import ShardingPlan

log = logging.getLogger("hybridrec")


def _sync_ok(ok: bool, env: DistEnv) -> bool:
    if env.group is None:
        return ok
    return not any_rank(not ok, env.group, env.device, "checkpoint_sync")


def _on_main(action: Callable[[], object], env: DistEnv) -> str:
    """Run filesystem `action` on rank 0 only and tell every rank how it went: "" when it
    worked, else its OSError (on rank 0) or "on rank 0" (elsewhere), so no rank waits on a
    directory that will never come."""
    error = ""
    if env.is_main:
        try:
            action()
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    return "" if _sync_ok(not error, env) else error or "on rank 0"


def _gather(obj: Any, env: DistEnv) -> list[Any]:
    if env.group is None:
        return [obj]
    return all_gather_object(obj, env.group, "checkpoint_gather")


def save_checkpoint(
    root: Path,
    state: TrainState,
    model: nn.Module,
    dense_opt: torch.optim.Optimizer,
    signature: dict[str, Any],
    plan: ShardingPlan | None,
    env: DistEnv,
    keep: int = 3,
) -> Path:
    """Write checkpoint `step_<state.step>` under `root` atomically; returns its path."""
    root = Path(root)
    final = root / f"step_{state.step}"
    tmp = root / f".step_{state.step}.tmp"

    def make_tmp() -> None:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)

    failed = _on_main(make_tmp, env)  # the directory exists before anyone writes
    if failed:
        raise CheckpointError(
            f"saving checkpoint step {state.step} failed: cannot create {tmp} ({failed})"
        )
    error = ""
    start = time.perf_counter()
    modules = embedding_modules(model)
    # from every rank: rank 0 may hold no rows to count steps with
    counts = {c for c in _gather(sparse_step(modules), env) if c is not None}
    entries: dict[str, Any] = {}
    shards_meta: list[dict[str, Any]] = []
    error, full = "", False
    try:
        shards = []
        for spec, weight, st in shard_views(modules):
            if spec.table in replicated_tables(modules) and env.rank != 0:
                continue  # a replica: rank 0's copy is the one saved
            shards.append(
                {
                    "table": spec.table,
                    "rows": (spec.row_start, spec.row_end),
                    "cols": (spec.col_start, spec.col_end),
                    "weight": weight.cpu(),
                    "state": {k: v.cpu() for k, v in st.items()},
                }
            )
        name = f"shards_rank{env.rank}.pt"
        entries[name] = write_file({"shards": shards}, tmp / name)
        shards_meta = [
            {
                "file": name,
                "index": i,
                "table": s["table"],
                "rows": list(s["rows"]),
                "cols": list(s["cols"]),
                "state": sorted(s["state"]),
            }
            for i, s in enumerate(shards)
        ]
        assert len(counts) <= 1, f"ranks disagree on the sparse step count: {counts}"
        if env.is_main:
            dense = {
                "model": dense_state(model),
                "optimizer": dense_opt.state_dict(),
                "sparse_step": max(counts, default=0),
                "rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            }
            entries["dense.pt"] = write_file(dense, tmp / "dense.pt")
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = f"rank {env.rank}: {type(e).__name__}: {e}"
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
    gathered = _gather((entries, shards_meta, error, full), env)
    errors = [g[2] for g in gathered if g[2]]
    if errors:
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = list_checkpoints(root)
        intact = (
            f"the previous checkpoint {previous[-1]} is intact" if previous else "no checkpoint"
        )
        what = (
            room_advice(root, previous, keep)
            if any(g[3] for g in gathered)
            else "fix the cause above and resume"
        )
        raise CheckpointError(
            f"saving checkpoint step {state.step} failed ({'; '.join(errors)}); {intact}: {what}"
        )
    if env.is_main:
        files = {k: v for g in gathered for k, v in g[0].items()}
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": state.step,
            "data_position": state.data_position,
            "extra": state.extra,
            "world_size": env.world_size,
            "plan": None
            if plan is None
            else [{"table": tp.table, "sharding": tp.sharding.value} for tp in plan.tables],
            "signature": signature,
            "files": files,
            "shards": [s for g in gathered for s in g[1]],
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        try:
            with (tmp / "manifest.json").open("w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(root)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"rank 0: {e}"
        for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    if not _sync_ok(not error, env):
        raise CheckpointError(
            f"saving checkpoint step {state.step} failed: {error or 'on rank 0'}; the previous "
            f"checkpoints are intact (checkpoint.keep rotates only after a successful save)"
        )
    if env.is_main:
        log.info("saved checkpoint %s (%.1fs)", final, time.perf_counter() - start)
    return final


def room_advice(root: Path, previous: list[Path], keep: int) -> str:
    """What frees room after a save failed on a full disk. A save needs room for one more
    checkpoint beside the ones kept (rotation deletes only after a save succeeds), so
    deleting older ones helps now; a lower checkpoint.keep helps only from the next save on,
    and only where several are kept (never at keep=1, nor with one checkpoint so far)."""
    if not previous:
        return f"free space on the disk of {root}, or set checkpoint.dir to one with room"
    newest = previous[-1].name
    older = ", ".join(p.name for p in previous[:-1])
    if older:
        advice = f"free space: delete {older} in {root} (keep {newest} to resume from)"
    else:
        advice = (
            f"free space on the disk of {root} (a save needs room for a second checkpoint "
            f"beside {newest}), or copy {newest} to a disk with room and set checkpoint.dir there"
        )
    if older and keep > 1:  # the disk held `keep` of them: fewer fit from then on
        advice += f"; a lower checkpoint.keep (now {keep}) keeps fewer from then on"
    return advice + ", and resume"


def check_writable(root: Path, env: DistEnv) -> None:
    """Before training: `root` (checkpoint.dir) can be created and written (tried on rank 0,
    every rank raises), so a read-only or mistyped directory fails now, not at the first
    save after hours of steps."""

    def try_write() -> None:
        Path(root).mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".write_test."):
            pass

    failed = _on_main(try_write, env)
    if failed:
        raise CheckpointError(
            f"checkpoint.dir={str(root)!r} cannot be written ({failed}); "
            "checkpoints could not be saved"
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
