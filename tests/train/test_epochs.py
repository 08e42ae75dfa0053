"""train.epochs: passes over a file dataset's train split, turned into steps at start."""

from __future__ import annotations

import json
import math

import pytest

from hybridrec.distributed import DistEnv
from hybridrec.train.trainer import Trainer
from tests.configs import make_config


def _cfg(*overrides: str):
    return make_config("device=cpu", *overrides)


def test_epochs_become_steps_over_the_train_split(tmp_path, sample_tsv):
    cfg = _cfg(
        "data=criteo_sample",
        "model=criteo_sample",
        "train.batch_size=32",
        "train.epochs=1.5",
        "train.log_every=1",
        "eval.every=0",
        f"data.cache_dir={tmp_path / 'cache'}",
    )
    trainer = Trainer(cfg, DistEnv(), tmp_path / "run")
    per_epoch = trainer.source.steps_per_epoch(32, "train")
    assert per_epoch >= 2
    assert cfg.train.steps == math.ceil(1.5 * per_epoch)  # not the default train.steps
    trainer.fit()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if r["split"] == "train") == cfg.train.steps


def test_epochs_are_refused_where_they_mean_nothing():
    with pytest.raises(ValueError, match=r"train.epochs=1.0: data=synthetic is endless"):
        _cfg("train.epochs=1")
    with pytest.raises(ValueError, match=r"train.epochs must be > 0, got 0"):
        _cfg("data=criteo_sample", "model=criteo_sample", "train.epochs=0")
