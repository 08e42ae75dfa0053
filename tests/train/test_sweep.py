"""Hydra sweeps whose jobs are multi-rank runs, and the sweep summary.

The smoke test runs the real CLI: `-m sharding=table_wise,row_wise launcher.nproc_per_node=2`
is 2 jobs, each launching 2 gloo ranks with torch elastic. Each job must write its own
metrics.jsonl (from 2 ranks: both leave a log) and its own offline W&B run (grouped by sweep,
named by the swept value), the two shardings must give the same losses (the equivalence
rule: sharding is an execution strategy), and the summary must have one row per job. A failing job must show up in the summary as failed and fail the sweep.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hybridrec.configure import validate
from hybridrec.train.sweep import _quote, final_metrics, objective, write_summary
from tests.cli import run_cli
from tests.train.wandb_file import offline_run_file, read_records, run_record

SMALL = [
    "train.steps=4",
    "train.log_every=2",
    "train.batch_size=64",
    "eval.batches=1",
    "eval.batch_size=128",
    "device=cpu",
    "seed=3",
]


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    wandb = {
        k: str(cwd / k.lower()) for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")
    }
    return run_cli(
        *args, cwd=cwd, WANDB_MODE="offline", WANDB_SILENT="true", HOME=str(cwd), **wandb
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rank_logs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("ranks/*/attempt_0/*") if p.is_dir())


@pytest.mark.slow
def test_multirun_two_jobs_of_two_ranks(tmp_path):
    sweep = tmp_path / "sweep"
    out = _cli(
        [
            "-m",
            "sharding=table_wise,row_wise",
            "launcher.nproc_per_node=2",
            "logger=wandb",
            *SMALL,
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = []
    for job, sharding in (("0", "table_wise"), ("1", "row_wise")):
        rows = _rows(sweep / job / "metrics.jsonl")
        assert [r["step"] for r in rows] == [2, 4, 4], rows
        assert _rank_logs(sweep / job) == ["0", "1"]  # two ranks ran this job
        losses.append([r["loss"] for r in rows if r["split"] == "train"])
        run = run_record(read_records(offline_run_file(sweep / job)))  # rank 0's W&B run
        assert (run.run_group, run.display_name) == (str(sweep), f"sharding={sharding}")
    assert losses[0] == pytest.approx(losses[1], rel=1e-4, abs=1e-5)
    assert not (tmp_path / "outputs").exists()  # ranks wrote into the job dirs only

    summary = json.loads((sweep / "summary.json").read_text())
    jobs = summary["jobs"]
    assert [j["job"] for j in jobs] == [0, 1]
    assert [j["status"] for j in jobs] == ["completed", "completed"]
    assert jobs[0]["overrides"][0] == "sharding=table_wise"
    assert jobs[1]["overrides"][0] == "sharding=row_wise"
    assert "launcher.nproc_per_node=2" in summary["common_overrides"]
    for j in jobs:
        final = final_metrics(sweep / j["dir"] / "metrics.jsonl")
        assert j["auc"] == final["auc"] is not None and j["loss"] == final["loss"]
    table = (sweep / "summary.md").read_text()
    assert table.count("| completed |") == 2
    assert "Sweep summary" in out.stdout and "| sharding=row_wise | completed |" in out.stdout


@pytest.mark.slow
def test_a_failed_job_is_in_the_summary_and_fails_the_sweep(tmp_path):
    """sharding=none cannot run on 2 ranks: that job fails before launching anything; the
    other one still runs (here one rank in this process), and the sweep exits non-zero."""
    sweep = tmp_path / "sweep"
    out = _cli(
        ["-m", "sharding=none,row_wise", "launcher.nproc_per_node=2,1", *SMALL]
        + [f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
    )
    assert out.returncode != 0
    jobs = json.loads((sweep / "summary.json").read_text())["jobs"]
    status = {" ".join(j["overrides"][:2]): j["status"] for j in jobs}
    assert status == {
        "sharding=none launcher.nproc_per_node=2": "failed",
        "sharding=none launcher.nproc_per_node=1": "completed",
        "sharding=row_wise launcher.nproc_per_node=2": "completed",
        "sharding=row_wise launcher.nproc_per_node=1": "completed",
    }
    failed = next(j for j in jobs if j["status"] == "failed")
    assert "launcher.nproc_per_node=2 starts 2 ranks, but sharding=none" in failed["error"]
    assert failed["auc"] is None
    assert "Sweep summary" in out.stdout  # printed even though Hydra stopped early


def test_summary_from_job_dirs(tmp_path):
    """The table is rebuilt from the job directories: job.json, .hydra/ and metrics.jsonl."""
    for num, sharding, loss in ((0, "table_wise", 0.5), (1, "row_wise", 0.4)):
        d = tmp_path / str(num)
        d.mkdir()
        info = {"job": num, "overrides": [f"sharding={sharding}", "train.steps=4"]}
        info |= {"status": "completed", "error": None, "wall_s": 1.0}
        (d / "job.json").write_text(json.dumps(info))
        rows = [
            {"step": 2, "split": "train", "loss": 0.9, "samples_per_sec": 100.0},
            {"step": 4, "split": "train", "loss": loss, "samples_per_sec": 300.0},
            {"step": 4, "split": "eval", "auc": 0.75},
        ]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{cut")
    dead = tmp_path / "2" / ".hydra"  # killed before Hydra could write job.json
    dead.mkdir(parents=True)
    (dead / "overrides.yaml").write_text("- sharding=column_wise\n- train.steps=4\n")
    (tmp_path / "not_a_job").mkdir()

    printed = write_summary(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["common_overrides"] == ["train.steps=4"]
    jobs = summary["jobs"]
    assert [(j["dir"], j["status"]) for j in jobs] == [
        ("0", "completed"),
        ("1", "completed"),
        ("2", "unknown"),
    ]
    assert (jobs[1]["loss"], jobs[1]["auc"], jobs[1]["samples_per_sec"]) == (0.4, 0.75, 200.0)
    assert jobs[2]["loss"] is None
    assert "| 1 | sharding=row_wise | completed | 0.40000 | 0.7500 | 200 | 1.0 |" in printed
    assert (tmp_path / "summary.md").read_text().count("\n| ") == 4  # header + 3 jobs


def test_regression_jobs_report_their_rmse(tmp_path):
    """A regression run logs RMSE, no AUC: the summary gains a final RMSE column and the
    value a sweeper reads is the RMSE."""
    for num, task, metrics in ((0, "binary", {"auc": 0.7}), (1, "regression", {"rmse": 0.93})):
        d = tmp_path / str(num)
        d.mkdir()
        info = {"job": num, "overrides": [f"model.task={task}"], "status": "completed"}
        (d / "job.json").write_text(json.dumps(info | {"error": None, "wall_s": 1.0}))
        rows = [{"step": 4, "split": "train", "loss": 0.5}, {"step": 4, "split": "eval", **metrics}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    final = final_metrics(tmp_path / "1" / "metrics.jsonl")
    assert (final["auc"], final["rmse"], objective(final)) == (None, 0.93, 0.93)
    binary = final_metrics(tmp_path / "0" / "metrics.jsonl")
    assert (binary["auc"], binary["rmse"], objective(binary)) == (0.7, None, 0.7)
    printed = write_summary(tmp_path)
    assert "| final loss | final AUC | final RMSE | samples/s |" in printed
    assert "| 0 | model.task=binary | completed | 0.50000 | 0.7000 | - | - | 1.0 |" in printed
    assert "| 1 | model.task=regression | completed | 0.50000 | - | 0.9300 | - | 1.0 |" in printed


def test_retrieval_jobs_report_hr_and_ndcg_of_their_val_split(tmp_path):
    """A retrieval run logs no AUC: the summary shows HR@K and NDCG@K at the smallest K of
    its last val evaluation (not the test row after training), the sweeper gets its HR@K;
    rows named "eval" (files written before rows were named by their split) read as val."""
    val = {"hr@10": 0.13, "ndcg@10": 0.06, "hr@50": 0.41, "ndcg@50": 0.12}
    test = {"hr@10": 0.09, "ndcg@10": 0.045, "hr@50": 0.3, "ndcg@50": 0.08}
    for num, split in ((0, "val"), (1, "eval")):
        d = tmp_path / str(num)
        d.mkdir()
        info = {"job": num, "overrides": [f"seed={num}"], "status": "completed"}
        (d / "job.json").write_text(json.dumps(info | {"error": None, "wall_s": 1.0}))
        rows = [
            {"step": 4, "split": "train", "loss": 6.5},
            {"step": 4, "split": split, **val},
            {"step": 4, "split": "test", **test},
        ]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    final = final_metrics(tmp_path / "0" / "metrics.jsonl")
    assert (final["split"], final["topk"], final["hr"], final["ndcg"]) == ("val", 10, 0.13, 0.06)
    assert objective(final) == 0.13 and objective(test) == 0.09
    assert final_metrics(tmp_path / "1" / "metrics.jsonl")["hr"] == 0.13
    printed = write_summary(tmp_path)
    assert "| final loss | final AUC | final HR@10 | final NDCG@10 | samples/s |" in printed
    assert "| 0 | seed=0 | completed | 6.50000 | - | 0.1300 | 0.0600 | - | 1.0 |" in printed
    only_test = tmp_path / "t.jsonl"  # evaluated test alone (data.eval_split=test)
    only_test.write_text(json.dumps({"step": 4, "split": "test", **test}) + "\n")
    assert final_metrics(only_test)["split"] == "test"


def test_launcher_config_is_validated():
    with pytest.raises(ValueError, match="launcher.nproc_per_node must be > 0, got 0"):
        validate({"launcher": {"nproc_per_node": 0}})
    with pytest.raises(ValueError, match="unknown config key 'launcher.nprocs'"):
        validate({"launcher": {"nprocs": 2}})
    assert validate({"launcher": {"nproc_per_node": 4}}).launcher.max_restarts == 0


def test_run_dir_override_is_quoted():
    assert _quote("/tmp/a b/c=d,e") == "'/tmp/a b/c=d,e'"
    assert _quote("/tmp/it's") == "'/tmp/it\\'s'"
