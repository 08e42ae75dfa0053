"""The open-world audit's dynamic-table section: resume and load (docs/dynamic.md, "What a
resume may change"), through hybridrec-train in a subprocess."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from tests.audit.cases import Case, _outcome
from tests.cli import run_cli


# -- dynamic tables: resume and load (docs/dynamic.md, "What a resume may change") -------------
def dynamic_cases() -> list[Case]:
    """Issue 41, silently wrong 1-4, through hybridrec-train on a data=table dataset with a
    dynamic user table (admit: count, evict: lru, 8 buckets): a resume that changes buckets or
    unknown, and checkpoints edited with their checksums recomputed (ids moved to other
    buckets, slot ids saved as float32). The same checks in the suite, cheaply:
    tests/train/test_dynamic_checkpoint_load.py (every invariant, the library's names),
    tests/data/test_dynamic_resume.py (the trainer's key names), tests/unit/test_dynamic_inputs.py
    (ids: empty batches, integer dtypes, float ids, 2^63-1)."""
    state: dict[str, Path] = {}

    def trained(work: Path) -> tuple[Path, Path]:
        """(dataset, checkpoint dir with step_6: ids admitted), made once."""
        if "data" not in state:
            from hybridrec.data.spec import parse_spec
            from hybridrec.data.tabular import preprocess_table
            from tests.data.tables import DYNAMIC_SPEC as SPEC
            from tests.data.tables import dynamic_columns as _cols
            from tests.data.tables import write_parquet

            data = work / "pq"
            preprocess_table(parse_spec(SPEC), [write_parquet(work / "t.parquet", _cols())], data)
            ck = work / "ck"
            proc = _train(work, data, ck, 6)
            if proc.returncode != 0:
                raise RuntimeError(f"the first run failed: {proc.stderr[-2000:]}")
            state["data"], state["ck"] = data, ck
        return state["data"], state["ck"]

    def resume_with(override: str, code: int, starts: str, contains: str) -> Callable:
        def check(work: Path) -> str | None:
            data, ck = trained(work)
            proc = _train(work, data, ck, 7, override)
            return _outcome(proc, code, starts, contains)

        return check

    def edited(edit: Callable[[dict], None], starts: str) -> Callable:
        def check(work: Path) -> str | None:
            data, ck = trained(work)
            copy = work / f"edited_{edit.__name__}"
            _edit_checkpoint(ck / "step_6", copy / "step_6", edit)
            proc = _train(work, data, copy, 7)
            return _outcome(proc, 1, "hybridrec-train: " + starts.format(ck=copy / "step_6"))

        return check

    step2 = "hybridrec-train: checkpoint {}"
    return [
        Case(
            "resume with +model.dynamic.user.buckets=4 (trained with 8)",
            resume_with(
                "+model.dynamic.user.buckets=4", 1, step2.format(""), "model.dynamic.user.buckets"
            ),
            "exit 1, one line naming model.dynamic.user.buckets and what to do",
        ),
        Case(
            "resume with +model.dynamic.user.unknown=row (trained with zeros)",
            resume_with(
                "+model.dynamic.user.unknown=row", 1, step2.format(""), "model.dynamic.user.unknown"
            ),
            "exit 1, one line naming model.dynamic.user.unknown and what to do",
        ),
        Case(
            "resume with +model.dynamic.user.evict=lfu (trained with lru)",
            resume_with("+model.dynamic.user.evict=lfu", 0, "", ""),
            "exit 0: the eviction may change (a warning names it)",
        ),
        Case(
            "resume from a checkpoint whose ids sit in other buckets (checksums recomputed)",
            edited(_ids_one_bucket_on, "checkpoint file {ck}/shards_rank0.pt: table user rows"),
            "exit 1, one line naming the file, the table and the row",
        ),
        Case(
            "resume from a checkpoint whose slot ids were saved as float32",
            edited(_ids_as_float32, "checkpoint file {ck}/shards_rank0.pt: table user rows"),
            "exit 1, one line: dyn_slot_id is float32, not int64",
        ),
    ]


def _train(work: Path, data: Path, ck: Path, steps: int, *more: str):  # noqa: ANN202
    return run_cli(
        "data=table", f"data.path={data}", "train.batch_size=4", "eval.batch_size=4",
        "eval.batches=1", f"train.steps={steps}", f"checkpoint.dir={ck}", "device=cpu",
        f"hydra.run.dir={work / 'runs' / str(len(list(work.glob('runs/*'))))}", *more,
        cwd=work,
    )  # fmt: skip


def _edit_checkpoint(src: Path, dst: Path, edit: Callable[[dict], None]) -> None:
    """A copy of checkpoint `src` at `dst` with table user's saved shard edited in place and
    the manifest's size and sha256 of the file recomputed (so the load's checks, not the
    checksum, are what meet the edit)."""
    from hybridrec.train.checkpoint.format import write_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((dst / "manifest.json").read_text())
    shards = torch.load(dst / "shards_rank0.pt", weights_only=True)
    edit(next(s for s in shards["shards"] if s["table"] == "user"))
    manifest["files"]["shards_rank0.pt"] = write_file(shards, dst / "shards_rank0.pt")
    (dst / "manifest.json").write_text(json.dumps(manifest))


def _ids_one_bucket_on(shard: dict) -> None:
    ids = shard["state"]["dyn_slot_id"]
    if not bool((ids >= 0).any()):
        raise RuntimeError("the saved map holds no id to move: train the first run longer")
    shard["state"]["dyn_slot_id"] = torch.roll(ids, 8)  # 64 rows in 8 buckets


def _ids_as_float32(shard: dict) -> None:
    shard["state"]["dyn_slot_id"] = shard["state"]["dyn_slot_id"].float()
