"""Loading a checkpoint under any sharding plan and world size.

A load copies into each of this rank's shards the overlapping parts of the saved rectangles
(shard files are memory-mapped, so a rank reads only what it needs) and checks that every
cell was covered. Before anything is copied, the manifest's file sizes (and sha256 sums,
unless `verify=False`) and the model signature are checked; every problem is a
CheckpointError naming the file. Files are read as data only (format.load_file), and a
manifest may list only the checkpoint's own file names.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridrec.safeload import UnsafeFileError, load_tensors
from hybridrec.sparse.api import EmbeddingModule, embedding_modules
from hybridrec.sparse.dynamic.check import map_problem
from hybridrec.train.checkpoint.dynamic import KeyName, library_key, policy_refusal
from hybridrec.train.checkpoint.format import (
    CONVERT,
    FILE_NAME,
    FORMAT_VERSION,
    CheckpointError,
    CorruptCheckpointError,
    TrainState,
    list_checkpoints,
    load_dense_state,
    sha256,
    shard_views,
    signature_differences,
    summarise,
    table_signature,
)
from hybridrec.types import Dynamic, TableConfig

# what torch.load raises for a file it cannot parse (truncated, damaged, not torch.save's)
UNREADABLE = (RuntimeError, EOFError, KeyError, pickle.UnpicklingError)


def read_manifest(path: Path, verify: bool = True) -> dict[str, Any]:
    """The manifest of checkpoint `path`, after checking every file's size (and checksum)."""
    path = Path(path)
    mf = path / "manifest.json"
    if not mf.is_file():
        raise CorruptCheckpointError(f"{path} is not a complete checkpoint: {mf} is missing")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(f"{mf} is corrupt: {e}") from None
    if not isinstance(manifest, dict):
        kind = type(manifest).__name__
        raise CorruptCheckpointError(f"{mf} is corrupt: a JSON {kind}, not an object")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{mf}: format version {manifest.get('format_version')} is not {FORMAT_VERSION}"
        )
    if not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("shards"), list):
        raise CorruptCheckpointError(f"{mf} is corrupt: it lacks its files or shards")
    for name in [*manifest["files"], *(s["file"] for s in manifest["shards"])]:
        if not isinstance(name, str) or not FILE_NAME.match(name) or name not in manifest["files"]:
            raise CheckpointError(
                f"{mf} lists file {name!r}, which is not one of this checkpoint's files "
                "(dense.pt, shards_rank<r>.pt); refused"
            )
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CorruptCheckpointError(f"checkpoint {path} is missing its file {name}")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise CorruptCheckpointError(
                f"checkpoint file {f} has {size} bytes, the manifest says "
                f"{meta['bytes']} (truncated or overwritten)"
            )
        if verify and sha256(f) != meta["sha256"]:
            raise CorruptCheckpointError(
                f"checkpoint file {f} is corrupt: sha256 differs from the manifest"
            )
    return manifest


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint was saved at (from its manifest)."""
    return int(read_manifest(path, verify=False)["step"])


def intact_before(path: Path) -> list[Path]:
    """The complete checkpoints older than `path` in its directory whose files all pass
    their checks and load as data, newest first (what a user can resume from when `path` is
    damaged or refused)."""
    step = checkpoint_step(path)
    intact = []
    for older in reversed(list_checkpoints(Path(path).parent)):
        try:
            if checkpoint_step(older) < step:
                manifest = read_manifest(older)  # every file's size and checksum
                for name in manifest["files"]:
                    load_tensors(older / name, mmap=True)  # data only (a planted file is not)
                intact.append(older)
        except (CheckpointError, UnsafeFileError, *UNREADABLE):
            continue
    return intact


def check_matches(
    path: Path,
    tables: list[TableConfig],
    sparse_opt: str,
    dense_opt: str,
    key_name: KeyName = library_key,
    anew: str = "load no checkpoint",
) -> None:
    """Before any table is built: the checkpoint holds these tables and optimizers (the
    dense part's shapes are checked once the model exists), and its dynamic tables' maps fit
    the tables' policies (dynamic.policy_refusal: `key_name` names the keys, `anew` says how
    to start without the checkpoint)."""
    manifest = read_manifest(path, verify=False)
    current = {
        "tables": table_signature(tables),
        "sparse_optimizer": sparse_opt,
        "dense_optimizer": dense_opt,
    }
    refused = policy_refusal(path, manifest, current["tables"], key_name, anew)
    if refused:
        raise CheckpointError(refused)
    diffs = signature_differences(manifest["signature"], current)
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} is for a different model: {summarise(diffs)}; pick the model it "
            "was saved with (its manifest.json names the tables), or checkpoint.resume=never"
        )


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


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def load_embeddings(
    path: Path,
    manifest: dict[str, Any],
    modules: list[EmbeddingModule],
    dynamic: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Copy saved rectangles into every local shard (any plan), checking full coverage.
    Each rectangle is checked before it is copied (check_saved: shapes, dtypes, finite
    values, and a dynamic table's map against its policy, from `dynamic`: the signature
    entries of the dynamic tables by name); CorruptCheckpointError naming the file, table and
    row otherwise."""
    files = ShardFiles(Path(path))
    by_table: dict[str, list[dict[str, Any]]] = {}
    for s in manifest["shards"]:
        by_table.setdefault(s["table"], []).append(s)
    checked: set[tuple[str, int]] = set()
    for spec, weight, state in shard_views(modules):
        rows, cols = (spec.row_start, spec.row_end), (spec.col_start, spec.col_end)
        covered = 0
        for saved in by_table.get(spec.table, []):
            r = _overlap(rows, tuple(saved["rows"]))
            c = _overlap(cols, tuple(saved["cols"]))
            if r is None or c is None:
                continue
            src = files(saved["file"])["shards"][saved["index"]]
            if (saved["file"], saved["index"]) not in checked:
                problem = check_saved(src, saved, state, (dynamic or {}).get(spec.table))
                if problem:
                    raise _refused(path, saved, problem)
                checked.add((saved["file"], saved["index"]))
            sr, sc = saved["rows"][0], saved["cols"][0]
            dst_r = slice(r[0] - rows[0], r[1] - rows[0])
            dst_c = slice(c[0] - cols[0], c[1] - cols[0])
            src_r, src_c = slice(r[0] - sr, r[1] - sr), slice(c[0] - sc, c[1] - sc)
            parts = {"weight": (weight, (dst_r, dst_c), src["weight"][src_r, src_c])}
            for name, buf in state.items():
                if name not in src["state"]:
                    raise CheckpointError(
                        f"checkpoint {path} has no optimizer state {name!r} for table {spec.table}"
                    )
                saved_state = src["state"][name]
                if buf.dim() == 1:  # row-wise state [rows]: one value per row, any columns
                    parts[name] = (buf, (dst_r,), saved_state[src_r])
                else:  # element-wise state [rows, cols], [rows, 1] for a width-1 shard
                    if saved_state.dim() == 1:  # a width-1 shard's, as older versions saved it
                        saved_state = saved_state.unsqueeze(1)
                    parts[name] = (buf, (dst_r, dst_c), saved_state[src_r, src_c])
            for name, (buf, at, part) in parts.items():
                row = nonfinite_row(part)
                if row is not None:
                    raise _refused(path, saved, f"row {r[0] + row}'s {name} is not finite")
                buf[at] = part.to(buf.device, buf.dtype)
            covered += (r[1] - r[0]) * (c[1] - c[0])
        if covered != spec.num_rows * spec.width:
            raise CheckpointError(
                f"checkpoint {path} does not cover table {spec.table} rows {rows[0]}:{rows[1]} "
                f"cols {cols[0]}:{cols[1]} ({covered} of {spec.num_rows * spec.width} values)"
            )


def _refused(path: Path, saved: dict[str, Any], problem: str) -> CorruptCheckpointError:
    """The one line refusing saved rectangle `saved` (its manifest entry) of checkpoint
    `path` for `problem`."""
    (r0, r1), name = saved["rows"], Path(path) / saved["file"]
    return CorruptCheckpointError(
        f"checkpoint file {name}: table {saved['table']} rows {r0}:{r1}: {problem}; hybridrec "
        "never writes that (an edited file?): resume from another checkpoint"
    )


def check_saved(
    src: dict[str, Any],
    saved: dict[str, Any],
    state: dict[str, torch.Tensor],
    table: dict[str, Any] | None,
) -> str | None:
    """What is wrong with saved rectangle `src` (its manifest entry `saved`) for a shard whose
    optimizer-state views are `state`, None if nothing: its weight [rows, cols] and each state
    array ([rows] row-wise, [rows, cols] or a width-1 shard's [rows] element-wise) in a dtype
    of the view's kind (an integer view takes its own dtype only), and a dynamic table's map
    (`table`: its signature entry) as hybridrec.sparse.dynamic.check states it (1-D arrays,
    read whole). Values copied are checked finite as they are copied (nonfinite_row)."""
    (r0, r1), (c0, c1) = saved["rows"], saved["cols"]
    n, width = r1 - r0, c1 - c0
    arrays = {"weight": src.get("weight"), **src.get("state", {})}
    for name, a in arrays.items():
        if name != "weight" and name not in state:
            continue  # not read by this model
        if not isinstance(a, torch.Tensor):
            return f"{name} is a {type(a).__name__}, not a tensor"
        view = state.get(name)
        row_wise = view is not None and view.dim() == 1
        shapes = [(n,)] if row_wise else [(n, width)] + ([(n,)] if width == 1 else [])
        if name != "weight" and tuple(a.shape) not in shapes:
            want = " or ".join(str(list(x)) for x in shapes)
            return f"{name} has shape {list(a.shape)}, not {want}"
        if name == "weight" and tuple(a.shape) != (n, width):
            return f"its weight has shape {list(a.shape)}, not {[n, width]}"
        want_float = view is None or view.is_floating_point()
        if a.is_floating_point() != want_float or (not want_float and a.dtype != view.dtype):
            want = _dtype(view.dtype) if view is not None else "a float"
            why = " (a float copy has rounded its values)" if a.is_floating_point() else ""
            return f"{name} is {_dtype(a.dtype)}, not {want}{why}"
    if table is None or "dyn_slot_id" not in state:
        return None
    policy = Dynamic(**table["dynamic"])
    return map_problem(src.get("state", {}), policy, table["num_rows"], r0, n)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nonfinite_row(x: torch.Tensor, chunk: int = 1 << 16) -> int | None:
    """The first row of x [rows, ...] holding a NaN or an inf, None if none; read in chunks of
    rows, so no mask as large as a table is made."""
    if not x.is_floating_point():
        return None
    for start in range(0, x.shape[0], chunk):
        bad = ~torch.isfinite(x[start : start + chunk])
        if bool(bad.any()):
            return start + int(bad.reshape(bad.shape[0], -1).any(1).nonzero()[0, 0])
    return None


DENSE_KEYS = ("model", "optimizer", "sparse_step", "rng_cpu", "rng_cuda")


def load_dense(path: Path) -> dict[str, Any]:
    """Checkpoint `path`'s dense.pt (data only), with every entry a load needs."""
    dense = load_file(path / "dense.pt")
    missing = [k for k in DENSE_KEYS if not isinstance(dense, dict) or k not in dense]
    if missing:
        raise CheckpointError(f"{path / 'dense.pt'} lacks {', '.join(missing)}: not a dense state")
    return dense


def load_checkpoint(
    path: Path,
    model: nn.Module,
    dense_opt: torch.optim.Optimizer,
    signature: dict[str, Any],
    verify: bool = True,
) -> TrainState:
    """Restore weights, optimizer state and RNG from `path` into this rank's model."""
    manifest = read_manifest(path, verify)
    refused = policy_refusal(path, manifest, signature["tables"])
    if refused:
        raise CheckpointError(refused)
    diffs = signature_differences(manifest["signature"], signature)
    if diffs:
        raise CheckpointError(f"checkpoint {path} is for a different model: {summarise(diffs)}")
    modules = embedding_modules(model)
    policies = {t["name"]: t for t in signature["tables"] if "dynamic" in t}
    load_embeddings(path, manifest, modules, policies)
    dense = load_dense(Path(path))
    load_dense_state(model, dense["model"])
    dense_opt.load_state_dict(dense["optimizer"])
    for module in modules:
        module.set_sparse_step(int(dense["sparse_step"]))
    torch.set_rng_state(dense["rng_cpu"])
    if dense["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(dense["rng_cuda"][: torch.cuda.device_count()])
    return TrainState(manifest["step"], manifest["data_position"], manifest.get("extra", {}))


def load_file(path: Path, mmap: bool = False) -> Any:
    """A checkpoint file as data only; a file holding anything else is refused with one
    line (`refusal`), and one torch cannot read (truncated or damaged after its checksum
    was taken, or under --no-verify) is a CorruptCheckpointError naming it."""
    try:
        return load_tensors(path, mmap=mmap)
    except UnsafeFileError as e:
        raise CheckpointError(refusal(e, Path(path).parent)) from None
    except UNREADABLE as e:
        raise CorruptCheckpointError(
            f"checkpoint file {path} cannot be read as a torch.save file (truncated or "
            f"damaged): {type(e).__name__}: {first_sentence(e)}"
        ) from None


def first_sentence(e: BaseException) -> str:
    """The first sentence of an error's message (torch's run to a paragraph), one line."""
    text = " ".join(str(e).split())
    return text.split(". ")[0].rstrip(".")


def refusal(e: UnsafeFileError, step_dir: Path) -> str:
    """What was refused in checkpoint `step_dir`, and what to do: the conversion only where
    it can work (numpy data an older writer left; never for a pickled callable or unknown
    class, which nothing should load), and the newest intact checkpoint before it."""
    if e.convertible:
        fix = (
            f"It holds numpy data, as an older writer left it: convert it once with {CONVERT} "
            f"{step_dir} (which builds numpy data only, never code)"
        )
    elif not e.globals:  # not a torch.save file at all (a plain pickle)
        fix = "It was not written by hybridrec (a foreign file): neither load nor convert it"
    else:
        fix = (
            "That is code, not data hybridrec writes (a planted or foreign file): neither load "
            "nor convert it"
        )
    try:
        older = intact_before(step_dir)
    except CheckpointError:
        older = []
    if older:
        fix += (
            f"; the newest intact checkpoint before it is {older[0]}: resume from it with "
            f"checkpoint.resume={older[0]}"
        )
    elif not e.convertible:
        fix += f"; no older intact checkpoint is in {step_dir.parent}"
    return f"{e}. {fix}"


class ShardFiles:
    """Memory-mapped shard files, opened once each."""

    def __init__(self, root: Path) -> None:
        self.root, self.cache = root, {}

    def __call__(self, name: str) -> dict[str, Any]:
        if name not in self.cache:
            self.cache[name] = load_file(self.root / name, mmap=True)
        return self.cache[name]
