"""eval.only: evaluate a checkpoint without training, under any plan and world size, with
the metrics the training run itself would report; clear errors when there is nothing to
evaluate."""

from __future__ import annotations

import json

import pytest

from hybridrec.distributed import DistEnv, init_distributed
from hybridrec.train.checkpoint import CheckpointError
from hybridrec.train.trainer import Trainer
from tests.cli import run_cli
from tests.distributed.harness import spawn
from tests.equivalence import make_cfg


def _cfg(ck_dir, mode="none", world=1, only=True):
    cfg = make_cfg(mode, "rowwise_adagrad", world)
    cfg.checkpoint.dir, cfg.train.steps, cfg.eval.batches = str(ck_dir), 4, 3
    cfg.eval.only = only
    return cfg


def _evaluate_only(env: DistEnv, ck_dir: str, mode: str):
    return Trainer(_cfg(ck_dir, mode, env.world_size), env).evaluate_only()["eval"]


@pytest.mark.slow
def test_eval_only_reports_what_training_reported_on_any_plan(tmp_path):
    env = init_distributed("cpu")
    trained = Trainer(_cfg(tmp_path, only=False), env, tmp_path / "train").fit()["eval"]
    again = Trainer(_cfg(tmp_path), env, tmp_path / "eval").evaluate_only()["eval"]
    assert again == trained
    rows = [json.loads(x) for x in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 4, "split": "val", **trained}]
    for got in spawn(3, _evaluate_only, str(tmp_path), "column_wise"):
        for k in ("auc", "logloss", "accuracy", "eval_samples"):
            assert got[k] == pytest.approx(trained[k], rel=1e-5, abs=1e-6), k


def test_eval_only_needs_something_to_evaluate(tmp_path):
    with pytest.raises(CheckpointError, match="eval.only: no complete checkpoint under"):
        Trainer(_cfg(tmp_path), init_distributed("cpu")).evaluate_only()
    out = run_cli("eval.only=true", "device=cpu", cwd=tmp_path)
    assert out.returncode != 0 and "eval.only evaluates a trained model" in out.stderr
