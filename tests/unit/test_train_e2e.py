"""End to end on CPU: the trainer learns the synthetic teacher; the CLI runs and writes metrics."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridrec.distributed import init_distributed
from hybridrec.train.trainer import Trainer
from tests.cli import REPO, run_cli
from tests.configs import make_config
from tests.equivalence import make_cfg


@pytest.mark.parametrize(
    "arch,sparse", [("dlrm", "rowwise_adagrad"), ("dcnv2", "adam"), ("dlrm", "sgd")]
)
def test_loss_falls_and_auc_beats_chance(tmp_path, arch, sparse):
    lr = {"rowwise_adagrad": 0.05, "adam": 0.01, "sgd": 1.0}[sparse]
    cfg = make_config(
        "train.steps=300",
        "train.batch_size=256",
        "train.log_every=25",
        "eval.every=0",
        "eval.batches=4",
        f"model.arch={arch}",
        f"optim.sparse.name={sparse}",
        f"optim.sparse.lr={lr}",
        "device=cpu",
    )
    result = Trainer(cfg, init_distributed("cpu"), tmp_path).fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert train[0]["step"] == 25 and train[-1]["step"] == 300
    assert all({"step", "loss", "samples_per_sec"} <= r.keys() for r in train)
    first, last = train[0]["loss"], sum(r["loss"] for r in train[-3:]) / 3
    assert last < first - 0.02, (first, last)
    evals = [r for r in rows if r["split"] == "val"]
    assert len(evals) == 1 and evals[0]["auc"] == result["eval"]["auc"]
    assert result["eval"]["auc"] > 0.7


def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=cwd)


def test_cli_help_and_short_run(tmp_path):
    out = _run_cli("--help", cwd=tmp_path)
    assert out.returncode == 0 and "hybridrec-train" in out.stdout
    assert "name: dlrm_tiny" in out.stdout and "sharding:" in out.stdout
    run_dir = tmp_path / "run"
    out = _run_cli(
        "train.steps=20",
        "train.log_every=10",
        "eval.batches=1",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20, 20] and "auc" in rows[-1]
    assert "step 20/20" in out.stderr
    # the run dir's log file (Hydra's main.log) holds the console's lines, not nothing
    assert "step 20/20" in (run_dir / "main.log").read_text()


def test_console_script_finds_its_configs(tmp_path):
    """`hybridrec-train` (the console script: hybridrec.main imported, not run as __main__)
    composes conf/ too, from any directory; it used to fail with "Primary config module 'conf'
    not found" while `python -m hybridrec.main` worked."""
    code = "import sys; from hybridrec.main import cli; sys.argv[0] = 'hybridrec-train'; cli()"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "hybridrec-train" in out.stdout and "name: dlrm_tiny" in out.stdout


def test_progress_bar_keeps_log_lines_whole(tmp_path):
    """With the progress bar (a terminal, or train.progress=bar), log lines printed while it
    runs start their own line: they used to be appended to the bar's ("...sps=250,159][12:07
    r0] eval @ step 20 ...")."""
    out = _run_cli(
        "train.steps=20",
        "train.log_every=10",
        "eval.batches=1",
        "train.progress=bar",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    segments = re.split(r"[\r\n]", out.stderr)
    evals = [s for s in segments if "eval @ step 20" in s]
    assert evals and all(s.startswith("[") for s in evals), evals
    assert any(s.startswith("train: 100%") for s in segments)


def test_cli_bad_value_is_a_clear_error(tmp_path):
    out = _run_cli("optim.sparse.name=adamw", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    typo = _run_cli("train.stpes=3", cwd=tmp_path)
    assert typo.returncode == 2 and "keys under 'train': steps, epochs, batch_size" in typo.stderr
    assert out.returncode != 0
    choices = "sgd, rowwise_adagrad, adam, adagrad"
    assert f"optim.sparse.name='adamw' is not one of: {choices}" in out.stderr


@pytest.mark.parametrize("table_dtype", ["bf16", "fp16"])
def test_low_precision_tables_train(tmp_path, table_dtype):
    cfg = make_config(
        "train.steps=200",
        "train.batch_size=256",
        "train.log_every=50",
        "eval.every=0",
        "eval.batches=4",
        f"model.table_dtype={table_dtype}",
        "device=cpu",
    )
    trainer = Trainer(cfg, init_distributed("cpu"), tmp_path)
    result = trainer.fit()
    weights = [w for _, w, _ in trainer.embeddings[0].shard_views()]
    assert all(
        w.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[table_dtype] for w in weights
    )
    assert result["eval"]["auc"] > 0.7


def test_each_logged_row_covers_the_steps_since_the_previous_row(tmp_path):
    """Phase times (and cache counters) reset when read, so each row must divide them by the
    steps since the previous row, not since the last eval."""
    cfg = make_cfg("none", "sgd", 1)
    cfg.train.steps, cfg.train.log_every, cfg.eval.every, cfg.eval.batches = 30, 10, 0, 1
    trainer = Trainer(cfg, init_distributed("cpu"), tmp_path)
    seen: list[int] = []
    report = trainer.timer.report
    trainer.timer.report = lambda steps: (seen.append(steps), report(steps))[1]
    trainer.fit()
    assert [n for n in seen if n != 1] == [10, 10, 10]  # report(1) drops eval/save time
