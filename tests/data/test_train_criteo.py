"""Training on real Criteo rows, end to end.

- `hybridrec-train data=criteo_sample` (the CLI, in a subprocess): the sample is preprocessed
  into the cache on first use (a second run reuses it), the loss falls, eval runs on val.
- `data=criteo data.path=<dir>` on 2 gloo ranks (table-wise sharding, the broadcast loader)
  gives the single-process losses: the loader is part of the equivalence principle.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hybridrec.distributed import DistEnv, init_distributed
from hybridrec.train.trainer import Trainer
from tests.cli import run_cli
from tests.data.tables import criteo_cfg
from tests.distributed.harness import spawn


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=cwd)


@pytest.mark.slow
def test_cli_trains_on_criteo_sample(tmp_path, sample_tsv):
    cache, run = tmp_path / "cache", tmp_path / "run"
    args = [
        "data=criteo_sample",
        f"data.cache_dir={cache}",
        "train.steps=40",
        "train.batch_size=32",
        "train.log_every=10",
        "eval.batch_size=10",
        "eval.every=0",
        "device=cpu",
    ]
    out = _cli(*args, f"hydra.run.dir={run}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "preprocessing" in out.stderr and "rows=200, train=160, val=20, test=20" in out.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [10, 20, 30, 40]
    assert train[-1]["loss"] < train[0]["loss"]
    evals = [r for r in rows if r["split"] == "val"]
    assert len(evals) == 1 and evals[0]["eval_samples"] == 20  # the whole val split, once
    (dataset,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert (dataset / "manifest.json").is_file()
    again = _cli(*args, f"hydra.run.dir={tmp_path / 'run2'}", cwd=tmp_path)
    assert again.returncode == 0 and "preprocessing" not in again.stderr
    mismatch = _cli(*args, "model=dlrm_tiny", f"hydra.run.dir={tmp_path / 'r3'}", cwd=tmp_path)
    assert mismatch.returncode != 0
    assert "has 26 categorical tables but the model (dlrm_tiny) has 6" in mismatch.stderr


def _losses(env: DistEnv, path: str, sharding: str, loader: str) -> list[float]:
    trainer = Trainer(criteo_cfg(path, sharding, loader, env.world_size), env)
    it = trainer.loader("train", 0)
    losses = [trainer.global_mean(trainer.train_step(next(it))) for _ in range(8)]
    it.close()
    return losses + [trainer.evaluate()["logloss"]]


@pytest.mark.slow
def test_two_ranks_broadcast_loader_match_single_process(sample_dataset):
    ref = _losses(init_distributed("cpu"), str(sample_dataset), "none", "per_rank")
    for res in spawn(2, _losses, str(sample_dataset), "table_wise", "broadcast"):
        assert res == pytest.approx(ref, rel=1e-4, abs=1e-5)


def test_many_epochs_of_a_small_split_are_warned_about(sample_dataset, caplog):
    cfg = criteo_cfg(str(sample_dataset), "none", "per_rank", 1)  # 3000 steps of 24 over 160 rows
    with caplog.at_level("WARNING", logger="hybridrec"):
        Trainer(cfg, init_distributed("cpu"))
    assert (
        "train.steps=3000 is 500 epochs of the training split (6 steps of 24 samples each): "
        "set train.epochs=1" in caplog.text
    )
    caplog.clear()
    cfg.train.epochs = 1
    with caplog.at_level("WARNING", logger="hybridrec"):
        Trainer(cfg, init_distributed("cpu"))
    assert "epochs of the training split" not in caplog.text
