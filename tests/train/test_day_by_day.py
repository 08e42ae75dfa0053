"""Day by day with dynamic tables (docs/dynamic.md, issue 41): the recipe's commands run as
written, at small scale; `train.count_from=resume` (one more pass over today's data, and a
crash-restart that still ends where it would have); `--stats-from` (one raw value, one input,
every day) and the resume warning when statistics differ; the unknown rate over a split's
rows only; an empty val split that warns and exits 0."""

from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from hybridrec.data.dataset import open_dataset
from hybridrec.data.preprocess_cli import main as preprocess_main
from hybridrec.distributed import init_distributed
from hybridrec.train.checkpoint.format import list_checkpoints
from hybridrec.train.export_cli import main as export_main
from hybridrec.train.trainer import Trainer
from tests.cli import REPO, run_cli
from tests.configs import make_config

STREAM = ["--days", "3", "--rows-per-day", "3000", "--users", "600", "--items", "120"]
SPEC = {
    "label": {"column": "clicked", "task": "binary"},
    "dense": [{"column": "x0", "transform": "standardize"}, {"column": "x1"}],
    "sparse": [
        {
            "name": "user",
            "column": "user",
            "encoding": "dynamic",
            "capacity": 256,
            "policy": {"evict": "lru"},
        },
        {
            "name": "item",
            "column": "item",
            "encoding": "dynamic",
            "capacity": 128,
            "policy": {"evict": "lru"},
        },
    ],  # fmt: skip
    "tables": [{"name": "user", "width": 8}, {"name": "item", "width": 8}],
    "split": {"by": "fraction", "val": 0.1, "test": 0.1, "seed": 0},
}
SMALL = [  # what the test adds to each hybridrec-train command of the recipe
    "train.batch_size=256",
    "eval.batch_size=512",
    "eval.every=0",
    "train.log_every=1",
    "device=cpu",
]


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> Path:
    """A directory with spec.yaml and day_1/, day_2/ (two days of examples/dynamic's stream,
    one Parquet file each: new ids every day, x0 ~ N(0, 1) drawn afresh)."""
    import runpy

    tmp = tmp_path_factory.mktemp("days")
    make = runpy.run_path(str(REPO / "examples" / "dynamic" / "make_stream.py"))["main"]
    make([str(tmp / "gen"), *STREAM])
    for d in (1, 2):
        (tmp / f"day_{d}").mkdir()
        shutil.copy(tmp / "gen" / "stream" / f"day={d}" / "part-0.parquet", tmp / f"day_{d}")
    (tmp / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    return tmp


def _work(days: Path, tmp_path: Path) -> Path:
    for name in ("day_1", "day_2", "spec.yaml"):
        src, dst = days / name, tmp_path / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return tmp_path


def _recipe() -> list[list[str]]:
    """The commands of docs/dynamic.md's Day by day section, in order (comments dropped)."""
    text = (REPO / "docs" / "dynamic.md").read_text()
    section = text.split("## Day by day", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                commands.append(shlex.split(line))
    return commands


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _steps_per_epoch(data: Path, batch: int = 256) -> int:
    m = open_dataset(data).manifest
    lo, hi = m.splits["train"]
    return (hi - lo) // batch


@pytest.mark.slow
def test_the_recipe_runs_as_written(days, tmp_path):
    """The doc's commands, in order, with only the small-scale settings added (SMALL) and N
    replaced by the first run's last step: day 2 resumed trains exactly one pass (steps
    N+1..N+M, no arithmetic), the warm start one pass too (not 3,000 steps), and the stats
    carried from day 1 leave no warning."""
    work = _work(days, tmp_path)
    commands = _recipe()
    assert [c[0] for c in commands] == [
        "hybridrec-preprocess",
        "hybridrec-preprocess",
        "hybridrec-train",
        "hybridrec-train",
        "hybridrec-export",
        "hybridrec-train",
    ]
    n = None
    runs = []
    for i, argv in enumerate(commands):
        argv = [a.replace("step_N", f"step_{n}") for a in argv]
        if argv[0] == "hybridrec-preprocess":
            args = [str(work / a) if not a.startswith("--") else a for a in argv[1:]]
            assert preprocess_main(args) == 0, argv
        elif argv[0] == "hybridrec-export":
            assert export_main([str(work / a) for a in argv[1:]]) == 0, argv
        else:
            run = work / f"run_{i}"
            out = run_cli(*argv[1:], *SMALL, f"hydra.run.dir={run}", cwd=work)
            assert out.returncode == 0, out.stderr[-3000:]
            assert "standardized with other statistics" not in out.stderr
            runs.append((run, out.stderr))
            if n is None:
                n = int(list_checkpoints(work / "ckpt" / "run")[-1].name.split("_")[1])
    m1, m2 = _steps_per_epoch(work / "day_1_bin"), _steps_per_epoch(work / "day_2_bin")
    assert n == m1 > 5 and m2 > 5
    (day1, _), (day2, log2), (warm, log3) = runs
    assert [r["step"] for r in _rows(day2) if r["split"] == "train"] == list(
        range(n + 1, n + m2 + 1)
    )
    counted = f"train.count_from=resume: steps {n + 1}..{n + m2}, the training data from its "
    assert counted + f"batch 0 (counted from step {n})" in log2
    assert list_checkpoints(work / "ckpt" / "run")[-1].name == f"step_{n + m2}"
    assert [r["step"] for r in _rows(warm) if r["split"] == "train"][-1] == m2
    assert "initialised weights from" in log3
    # day 2 was standardized with day 1's statistics, and says so
    col = open_dataset(work / "day_2_bin").manifest.schema["dense"]["columns"][0]
    first = open_dataset(work / "day_1_bin").manifest.schema["dense"]["columns"][0]
    assert (col["train_mean"], col["train_std"]) == (first["train_mean"], first["train_std"])
    assert col["own_mean"] != first["train_mean"]


def _train(data: Path, run: Path, *extra: str) -> tuple[Trainer, dict]:
    cfg = make_config("data=table", f"data.path={data}", *SMALL, *extra)
    trainer = Trainer(cfg, init_distributed("cpu"), run)
    return trainer, trainer.fit()


def _prepare(work: Path, *days_: int, stats_from: bool = True) -> None:
    for d in days_:
        argv = ["--spec", str(work / "spec.yaml"), "--input", str(work / f"day_{d}")]
        argv += ["--output", str(work / f"day_{d}_bin")]
        if d > 1 and stats_from:
            argv += ["--stats-from", str(work / f"day_{d - 1}_bin")]
        assert preprocess_main(argv) == 0


def test_count_from_resume_survives_a_crash_and_reruns(days, tmp_path):
    """Day 2 counted from the resumed step N, interrupted by N+4 (its later checkpoints
    removed, as a crash leaves them) and run again with the same command: it resumes at its
    last checkpoint k, ends at N+M (not k+M), and its losses are the uninterrupted run's, bit
    for bit. Run again once finished it trains nothing; on new data (even at the same path)
    one more pass."""
    work = _work(days, tmp_path)
    _prepare(work, 1, 2)
    day1 = ("train.epochs=1", f"checkpoint.dir={work / 'ck'}")
    _train(work / "day_1_bin", work / "r1", *day1)
    n = _steps_per_epoch(work / "day_1_bin")
    m = _steps_per_epoch(work / "day_2_bin")
    shutil.copytree(work / "ck", work / "ck_copy")
    day2 = ("train.epochs=1", "train.count_from=resume", "checkpoint.every=2", "checkpoint.keep=99")
    trainer, _ = _train(work / "day_2_bin", work / "r2", *day2, f"checkpoint.dir={work / 'ck'}")
    assert trainer.step == n + m and trainer.first == n
    whole = {r["step"]: r["loss"] for r in _rows(work / "r2") if r["split"] == "train"}
    assert sorted(whole) == list(range(n + 1, n + m + 1))
    # the crash: checkpoints after N+4 never written
    for p in list_checkpoints(work / "ck"):
        if int(p.name.split("_")[1]) > n + 4:
            shutil.rmtree(p)
    k = int(list_checkpoints(work / "ck")[-1].name.split("_")[1])
    assert n < k <= n + 4
    again, _ = _train(work / "day_2_bin", work / "r3", *day2, f"checkpoint.dir={work / 'ck'}")
    assert again.first == n and again.step == n + m  # not k + m
    resumed = {r["step"]: r["loss"] for r in _rows(work / "r3") if r["split"] == "train"}
    assert sorted(resumed) == list(range(k + 1, n + m + 1))
    assert all(resumed[s] == whole[s] for s in resumed)  # bitwise: the same batches, in order
    # run again once it finished: the same data, nothing more; new data at the same path
    # (day 1's files preprocessed into day_2_bin): one more pass
    done, _ = _train(work / "day_2_bin", work / "r5", *day2, f"checkpoint.dir={work / 'ck'}")
    assert done.first == n and done.step == n + m
    argv = ["--spec", str(work / "spec.yaml"), "--input", str(work / "day_1"), "--output",
            str(work / "day_2_bin"), "--overwrite"]  # fmt: skip
    assert preprocess_main(argv) == 0
    more, _ = _train(work / "day_2_bin", work / "r6", *day2, f"checkpoint.dir={work / 'ck'}")
    assert more.first == n + m and more.step == n + m + _steps_per_epoch(work / "day_2_bin")
    # without the key, day 2's train.epochs=1 counts from step 0: nothing left to train
    plain, _ = _train(work / "day_2_bin", work / "r4", "train.epochs=1",
                      f"checkpoint.dir={work / 'ck_copy'}")  # fmt: skip
    assert plain.step == n and plain.first == 0


def test_stats_from_carries_yesterdays_statistics_and_resume_warns_without(
    days, tmp_path, caplog, capsys
):
    work = _work(days, tmp_path)
    _prepare(work, 1)
    argv = ["--spec", str(work / "spec.yaml"), "--input", str(work / "day_2")]
    assert preprocess_main([*argv, "--output", str(work / "own_bin")]) == 0
    assert preprocess_main([*argv, "--output", str(work / "day_2_bin"), "--stats-from",
                            str(work / "day_1_bin")]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    day1 = open_dataset(work / "day_1_bin").manifest.schema["dense"]["columns"][0]
    own = open_dataset(work / "own_bin").manifest.schema["dense"]["columns"][0]
    carried = open_dataset(work / "day_2_bin").manifest.schema["dense"]["columns"][0]
    mean, std = day1["train_mean"], day1["train_std"]
    assert own["train_mean"] != mean  # each day's own statistics differ
    assert (carried["train_mean"], carried["train_std"]) == (mean, std)
    assert (carried["own_mean"], carried["own_std"]) == (own["train_mean"], own["train_std"])
    assert carried["stats_from"] == str((work / "day_1_bin").resolve())
    assert (
        f"x0: dense (standardize with mean {mean:.6g}, std {std:.6g} from "
        f"{(work / 'day_1_bin').resolve()}; this train split's: {own['train_mean']:.6g}, "
        f"{own['train_std']:.6g}), 3000 rows, 0 nulls\n"
    ) in printed
    # the stored values: (x - day 1's mean) / day 1's std, where the own dataset used its own
    a, b = open_dataset(work / "day_2_bin"), open_dataset(work / "own_bin")
    raw = b.dense[:, 0].astype(np.float64) * own["train_std"] + own["train_mean"]
    np.testing.assert_allclose(a.dense[:, 0], (raw - mean) / std, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(a.dense[:, 1], b.dense[:, 1])  # transform none: the same
    # a resume on the day's own statistics warns, naming the column and the fix
    _train(work / "day_1_bin", work / "r1", "train.epochs=1", f"checkpoint.dir={work / 'ck'}")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridrec"):
        _train(work / "own_bin", work / "r2", "train.epochs=1", "train.count_from=resume",
               f"checkpoint.dir={work / 'ck'}")  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if "standardized with other" in r.message]
    assert warned == [
        f"{work / 'own_bin'} is standardized with other statistics than the checkpoint's "
        f"training data (x0 mean {mean:.6g} -> {own['train_mean']:.6g}, std {std:.6g} -> "
        f"{own['train_std']:.6g}): the model sees other inputs for the same raw values; "
        f"preprocess it with --stats-from {work / 'day_1_bin'} (docs/dynamic.md, Day by day)"
    ]


def test_stats_from_a_dataset_without_the_column_is_a_usage_error(days, tmp_path, capsys):
    work = _work(days, tmp_path)
    other = dict(SPEC, dense=[{"column": "x1", "transform": "standardize"}])
    (work / "other.yaml").write_text(yaml.safe_dump(other))
    argv = ["--spec", str(work / "other.yaml"), "--input", str(work / "day_1")]
    assert preprocess_main([*argv, "--output", str(work / "x1_bin")]) == 0
    capsys.readouterr()
    argv = ["--spec", str(work / "spec.yaml"), "--input", str(work / "day_2"), "--output",
            str(work / "out"), "--stats-from", str(work / "x1_bin")]  # fmt: skip
    assert preprocess_main(argv) == 2
    assert capsys.readouterr().err == (
        f"hybridrec-preprocess: error: --stats-from {work / 'x1_bin'}: the dataset has no "
        "standardize statistics of dense column 'x0' (its dense columns: x1 (standardize)); "
        "give a dataset preprocessed with this spec\n"
    )
    assert not (work / "out").exists()


def test_the_unknown_rate_counts_the_splits_rows_only(days, tmp_path):
    """The eval loader fills a split's last batch by wrapping to its start; those rows' ids
    were counted too (0.7388 at batch 2048 where 0.733 was exact). Now the rate, like the
    metrics, is the same whatever the eval batch."""
    work = _work(days, tmp_path)
    _prepare(work, 1)
    trainer, _ = _train(work / "day_1_bin", work / "r", "train.steps=6")
    rows = trainer.source.split_rows("eval")
    assert rows % 7 and rows > 50
    results = {}
    for batch in (rows, 7, 64):  # one batch, no padding; then 7 and 64 with a wrapped tail
        trainer.cfg.eval.batch_size = batch
        results[batch] = trainer.evaluate(whole=True)
    exact = results[rows]
    assert 0 < exact["dynamic/user/unknown_rate"] < 1 and exact["eval_samples"] == rows
    for batch in (7, 64):
        got = results[batch]
        for key in ("dynamic/user/unknown_rate", "dynamic/item/unknown_rate", "eval_samples"):
            assert got[key] == exact[key], (batch, key)
        assert got["auc"] == pytest.approx(exact["auc"], abs=1e-6)


def test_an_empty_val_split_with_dynamic_tables_warns_and_trains(days, tmp_path, caplog):
    """It ended after training with KeyError: 'eval_samples' (exit 1): the unknown rates
    made the empty evaluation's metrics non-empty. Now it is what hashing tables do: a
    warning at start, no eval row, the run completes."""
    work = _work(days, tmp_path)
    spec = dict(SPEC, split={"by": "rows", "train_fraction": 1.0})
    (work / "spec.yaml").write_text(yaml.safe_dump(spec))
    _prepare(work, 1)
    with caplog.at_level(logging.WARNING, logger="hybridrec"):
        trainer, result = _train(work / "day_1_bin", work / "r", "train.steps=4", "eval.every=2")
    assert trainer.step == 4 and result["eval"] == {}
    assert "eval split 'val' is empty: evaluation will report nothing" in caplog.text
    assert {r["split"] for r in _rows(work / "r")} == {"train"}
