"""Checkpoints that survive crashes and load under any sharding plan and world size.

Format (version 1), one directory per checkpoint, `<checkpoint.dir>/step_<N>/`:

    manifest.json        what is where: step, world size, plan, model signature, every file
                         with its size and sha256, and every embedding rectangle
    shards_rank<r>.pt    rank r's embedding shards: per shard its table, row range, column
                         range, weight [rows, cols] and optimizer state (row-wise state
                         [rows], element-wise state [rows, cols])
    dense.pt             the dense module's state dict, the dense optimizer's state dict, the
                         sparse optimizers' step count, the data position and RNG states

Embedding rows are stored as the rectangles each rank held, not as whole tables, so a save
never gathers a table on one rank. A load, under any plan, copies into each of the new
shards the overlapping parts of the saved rectangles (files are memory-mapped, so a rank
reads only what it needs) and checks that every cell was covered. Replicated tables are
saved once (by rank 0).

Why not torch.distributed.checkpoint: its resharding works on DTensor placements, which
cannot express our uneven column and row splits (8 columns over 3 ranks: 3/3/2), and
ShardedTensor, which can, is deprecated. The format above is small, explicit and exact.

Saves are atomic: every rank writes into `.step_<N>.tmp`, the ranks agree that all writes
succeeded, then rank 0 writes the manifest and renames the directory to `step_<N>` (a
rename is atomic on one filesystem; multi-node runs need a shared filesystem). A failure
midway (a full disk) leaves the previous checkpoints untouched. Old ones are rotated out
(`checkpoint.keep`). A directory without a complete manifest is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridrec.distributed.env import DistEnv
from hybridrec.model.inference import MODEL_CONFIG_KEY
from hybridrec.sparse.api import EmbeddingModule, ShardView, embedding_modules
from hybridrec.types import ShardingPlan, TableConfig

log = logging.getLogger("hybridrec")

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or for a different model."""


def unwrap(module: nn.Module) -> nn.Module:
    """The plain module inside DDP and/or torch.compile wrappers (or the module itself)."""
    while True:
        inner = getattr(module, "_orig_mod", None) or getattr(module, "module", None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def model_signature(
    tables: list[TableConfig], model: nn.Module, sparse_opt: str, dense_opt: str
) -> dict[str, Any]:
    """What must match for a checkpoint to load: tables, dense shapes, optimizer kinds."""
    dense = unwrap(model.dense).state_dict()
    return {
        "tables": [{"name": t.name, "num_rows": t.num_rows, "dim": t.dim} for t in tables],
        "dense": {k: list(v.shape) for k, v in dense.items()},
        "sparse_optimizer": sparse_opt,
        "dense_optimizer": dense_opt,
    }


def signature_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two model signatures (empty = compatible)."""
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
    for key in sorted(set(saved["dense"]) | set(current["dense"])):
        a, b = saved["dense"].get(key), current["dense"].get(key)
        if a != b:
            diffs.append(f"dense {key}: checkpoint {a}, model {b}")
    for key in ("sparse_optimizer", "dense_optimizer"):
        if saved[key] != current[key]:
            diffs.append(f"{key}: checkpoint {saved[key]}, model {current[key]}")
    return diffs


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _write(obj: Any, path: Path) -> dict[str, Any]:
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
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


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


def _sync_ok(ok: bool, env: DistEnv) -> bool:
    if env.group is None:
        return ok
    t = torch.tensor([0 if ok else 1], device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=env.group)
    return int(t.item()) == 0


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
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj, group=env.group)
    return out


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
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    failed = _on_main(make_tmp, env)  # the directory exists before anyone writes
    if failed:
        raise CheckpointError(
            f"saving checkpoint step {state.step} failed: cannot create {tmp} ({failed})"
        )
    error = ""
    start = time.perf_counter()
    modules = embedding_modules(model)
    entries: dict[str, Any] = {}
    shards_meta: list[dict[str, Any]] = []
    error = ""
    try:
        shards = []
        for spec, weight, st in _shard_views(modules):
            if spec.table in _replicated(modules) and env.rank != 0:
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
        entries[name] = _write({"shards": shards}, tmp / name)
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
        if env.is_main:
            dense = {
                "model": unwrap(model.dense).state_dict(),
                "optimizer": dense_opt.state_dict(),
                "sparse_step": sparse_step(modules),
                "rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            }
            entries["dense.pt"] = _write(dense, tmp / "dense.pt")
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = f"rank {env.rank}: {type(e).__name__}: {e}"
    gathered = _gather((entries, shards_meta, error), env)
    errors = [g[2] for g in gathered if g[2]]
    if errors:
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = list_checkpoints(root)
        raise CheckpointError(
            f"saving checkpoint step {state.step} failed ({'; '.join(errors)}); "
            f"the previous checkpoint {previous[-1] if previous else '(none)'} is intact"
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
        raise CheckpointError(f"saving checkpoint step {state.step} failed: {error or 'on rank 0'}")
    if env.is_main:
        log.info("saved checkpoint %s (%.1fs)", final, time.perf_counter() - start)
    return final


def check_writable(root: Path, env: DistEnv) -> None:
    """Before training: `root` (checkpoint.dir) can be created and written (tried on rank 0,
    every rank raises), so a read-only or mistyped directory fails now, not at the first
    save after hours of steps."""

    def try_write() -> None:
        Path(root).mkdir(parents=True, exist_ok=True)
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


def sparse_step(modules: list[EmbeddingModule]) -> int:
    """The sparse optimizers' step count (the same in every embedding module)."""
    counts = {m.sparse_step for m in modules}
    assert len(counts) <= 1, f"embedding modules disagree on their step count: {counts}"
    return counts.pop() if counts else 0


def _shard_views(modules: list[EmbeddingModule]) -> list[ShardView]:
    return [view for m in modules for view in m.shard_views()]


def _replicated(modules: list[EmbeddingModule]) -> set[str]:
    return {t for m in modules for t in m.replicated_tables()}


def read_manifest(path: Path, verify: bool = True) -> dict[str, Any]:
    """The manifest of checkpoint `path`, after checking every file's size (and checksum)."""
    path = Path(path)
    mf = path / "manifest.json"
    if not mf.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {mf} is missing")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mf} is corrupt: {e}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{mf}: format version {manifest.get('format_version')} is not {FORMAT_VERSION}"
        )
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is missing its file {name}")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(
                f"checkpoint file {f} has {size} bytes, the manifest says "
                f"{meta['bytes']} (truncated or overwritten)"
            )
        if verify and _sha256(f) != meta["sha256"]:
            raise CheckpointError(
                f"checkpoint file {f} is corrupt: sha256 differs from the manifest"
            )
    return manifest


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint was saved at (from its manifest)."""
    return int(read_manifest(path, verify=False)["step"])


def resolve_resume(root: str | None, resume: str) -> Path | None:
    """`never` -> None; `auto` -> the newest complete checkpoint under root (or None);
    anything else -> that checkpoint directory, which must exist."""
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(Path(root)) if root else []
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.resume={resume!r}: no such checkpoint directory")
    return path


class _Files:
    """Memory-mapped shard files, opened once each."""

    def __init__(self, root: Path) -> None:
        self.root, self.cache = root, {}

    def __call__(self, name: str) -> dict[str, Any]:
        if name not in self.cache:
            self.cache[name] = torch.load(
                self.root / name, map_location="cpu", mmap=True, weights_only=True
            )
        return self.cache[name]


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def load_embeddings(path: Path, manifest: dict[str, Any], modules: list[EmbeddingModule]) -> None:
    """Copy saved rectangles into every local shard (any plan), checking full coverage."""
    files = _Files(Path(path))
    by_table: dict[str, list[dict[str, Any]]] = {}
    for s in manifest["shards"]:
        by_table.setdefault(s["table"], []).append(s)
    for spec, weight, state in _shard_views(modules):
        rows, cols = (spec.row_start, spec.row_end), (spec.col_start, spec.col_end)
        covered = 0
        for saved in by_table.get(spec.table, []):
            r = _overlap(rows, tuple(saved["rows"]))
            c = _overlap(cols, tuple(saved["cols"]))
            if r is None or c is None:
                continue
            src = files(saved["file"])["shards"][saved["index"]]
            sr, sc = saved["rows"][0], saved["cols"][0]
            dst_r = slice(r[0] - rows[0], r[1] - rows[0])
            dst_c = slice(c[0] - cols[0], c[1] - cols[0])
            src_r, src_c = slice(r[0] - sr, r[1] - sr), slice(c[0] - sc, c[1] - sc)
            weight[dst_r, dst_c] = src["weight"][src_r, src_c].to(weight.device, weight.dtype)
            for name, buf in state.items():
                if name not in src["state"]:
                    raise CheckpointError(
                        f"checkpoint {path} has no optimizer state {name!r} for table {spec.table}"
                    )
                saved_state = src["state"][name]
                if buf.dim() == 1:
                    buf[dst_r] = saved_state[src_r].to(buf.device)
                else:
                    buf[dst_r, dst_c] = saved_state[src_r, src_c].to(buf.device)
            covered += (r[1] - r[0]) * (c[1] - c[0])
        if covered != spec.num_rows * spec.width:
            raise CheckpointError(
                f"checkpoint {path} does not cover table {spec.table} rows {rows[0]}:{rows[1]} "
                f"cols {cols[0]}:{cols[1]} ({covered} of {spec.num_rows * spec.width} values)"
            )


def load_checkpoint(
    path: Path,
    model: nn.Module,
    dense_opt: torch.optim.Optimizer,
    signature: dict[str, Any],
    verify: bool = True,
) -> TrainState:
    """Restore weights, optimizer state and RNG from `path` into this rank's model."""
    manifest = read_manifest(path, verify)
    diffs = signature_differences(manifest["signature"], signature)
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} is for a different model:\n  " + "\n  ".join(diffs)
        )
    modules = embedding_modules(model)
    load_embeddings(path, manifest, modules)
    dense = torch.load(Path(path) / "dense.pt", map_location="cpu", weights_only=False)
    unwrap(model.dense).load_state_dict(dense["model"])
    dense_opt.load_state_dict(dense["optimizer"])
    for module in modules:
        module.set_sparse_step(int(dense["sparse_step"]))
    torch.set_rng_state(dense["rng_cpu"])
    if dense["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(dense["rng_cuda"][: torch.cuda.device_count()])
    return TrainState(manifest["step"], manifest["data_position"], manifest.get("extra", {}))


def export_checkpoint(path: Path, out_file: Path, verify: bool = True) -> dict[str, list[int]]:
    """One file with the full model state dict: `embeddings.<table>.weight` [rows, dim] and
    the dense modules by module path (`dense.bottom.0.weight`, ...). Returns name -> shape."""
    path = Path(path)
    manifest = read_manifest(path, verify)
    files = _Files(path)
    out: dict[str, torch.Tensor] = {}
    for t in manifest["signature"]["tables"]:
        full = torch.empty(t["num_rows"], t["dim"])
        covered = 0
        for s in (s for s in manifest["shards"] if s["table"] == t["name"]):
            (r0, r1), (c0, c1) = s["rows"], s["cols"]
            full[r0:r1, c0:c1] = files(s["file"])["shards"][s["index"]]["weight"]
            covered += (r1 - r0) * (c1 - c0)
        if covered != t["num_rows"] * t["dim"]:
            raise CheckpointError(f"checkpoint {path} does not cover table {t['name']}")
        out[f"embeddings.{t['name']}.weight"] = full
    dense = torch.load(path / "dense.pt", map_location="cpu", weights_only=False)
    out.update({f"dense.{k}": v for k, v in dense["model"].items()})
    model_cfg = manifest.get("extra", {}).get("model")
    if model_cfg is not None:  # so hybridrec.model.load_export needs nothing else
        out[MODEL_CONFIG_KEY] = json.dumps(model_cfg)  # type: ignore[assignment]
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(out_file.name + ".tmp")
    try:
        _write(out, tmp)
        os.replace(tmp, out_file)
    except OSError:
        tmp.unlink(missing_ok=True)  # no half-written file left beside the output
        raise
    return {k: list(v.shape) for k, v in out.items() if isinstance(v, torch.Tensor)}


def init_from_export(file: Path, model: nn.Module, tables: list[TableConfig]) -> None:
    """Warm start: copy an exported state dict's weights into this rank's shards and dense
    part (optimizer state starts fresh). Shapes must match; differences are listed."""
    file = Path(file)
    if not file.is_file():
        raise CheckpointError(f"model.init_from={str(file)!r}: no such file")
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
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
    for t in tables:
        w = state.get(f"embeddings.{t.name}.weight")
        if w is None:
            diffs.append(f"embeddings.{t.name}.weight: missing from the file")
        elif list(w.shape) != [t.num_rows, t.dim]:
            diffs.append(
                f"embeddings.{t.name}.weight: file {list(w.shape)}, model {[t.num_rows, t.dim]}"
            )
    dense = unwrap(model.dense)
    dense_state = {k.removeprefix("dense."): v for k, v in state.items() if k.startswith("dense.")}
    for k, v in dense.state_dict().items():
        if k not in dense_state:
            diffs.append(f"dense.{k}: missing from the file")
        elif dense_state[k].shape != v.shape:
            diffs.append(f"dense.{k}: file {list(dense_state[k].shape)}, model {list(v.shape)}")
    if diffs:
        raise CheckpointError(f"{file} does not fit this model:\n  " + "\n  ".join(diffs))
    for spec, weight, _ in _shard_views(embedding_modules(model)):
        src = state[f"embeddings.{spec.table}.weight"]
        weight.copy_(src[spec.row_start : spec.row_end, spec.col_start : spec.col_end])
    dense.load_state_dict(dense_state, strict=False)
