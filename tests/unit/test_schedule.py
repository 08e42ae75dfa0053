"""Learning-rate schedule: the factor per step, its validation, and that the trainer applies
it to both optimizers (an update at factor f equals an unscheduled update at lr * f)."""

from __future__ import annotations

import json

import pytest
import torch

from hybridrec.config import ScheduleConfig
from hybridrec.distributed import init_distributed
from hybridrec.optim.schedule import LRSchedule
from hybridrec.train.trainer import Trainer
from tests.configs import make_config
from tests.equivalence import make_cfg, snapshot


def _factors(steps, **kw):
    sched = LRSchedule(ScheduleConfig(**kw), 1.0, 1.0)
    return [sched.factor(s) for s in steps]


def test_factor_warmup_constant_decay_end():
    kw = {"warmup_steps": 4, "decay_start": 10, "decay_steps": 4, "end_factor": 0.1}
    got = _factors([1, 2, 3, 4, 5, 10, 11, 12, 14, 15, 1000], **kw)
    decay = [0.1 + 0.9 * (1 - t) ** 2 for t in (0.25, 0.5)]
    want = [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, *decay, 0.1, 0.1, 0.1]
    assert got == pytest.approx(want, abs=1e-12)
    assert _factors([1, 7], decay_start=0, decay_steps=8, decay_power=1.0) == [7 / 8, 1 / 8]
    assert not LRSchedule(ScheduleConfig(), 1.0, 1.0).enabled
    assert _factors([1, 10**6]) == [1.0, 1.0]


@pytest.mark.parametrize(
    "override,message",
    [
        ("optim.schedule.warmup_steps=-1", "optim.schedule.warmup_steps must be >= 0"),
        ("optim.schedule.decay_power=0", "optim.schedule.decay_power must be > 0"),
        ("optim.schedule.end_factor=1.5", r"optim.schedule.end_factor must be in \[0, 1\]"),
    ],
)
def test_bad_schedule_names_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        make_config(override)


def test_decay_inside_warmup_is_an_error():
    with pytest.raises(ValueError, match=r"decay_start=5 is inside the warm-up.*warmup_steps=10"):
        make_config(
            "optim.schedule.warmup_steps=10",
            "optim.schedule.decay_start=5",
            "optim.schedule.decay_steps=10",
        )


@pytest.mark.parametrize("sparse", ["sgd", "rowwise_adagrad", "adam"])
def test_trainer_scales_both_learning_rates(sparse):
    """Three scheduled steps (factors 1/4, 1/2, 3/4) equal three unscheduled runs whose
    learning rates are set by hand to the same values, step by step."""
    env = init_distributed("cpu")
    torch.set_num_threads(1)
    cfg = make_cfg("none", sparse, 1)
    cfg.optim.schedule.warmup_steps = 4
    scheduled = Trainer(cfg, env)
    plain = Trainer(make_cfg("none", sparse, 1), env)
    base = (cfg.optim.dense.lr, cfg.optim.sparse.lr)
    for s in range(3):
        batch = scheduled.train_batch(s)
        scheduled.train_step(batch)
        f = (s + 1) / 4
        assert scheduled.lr == pytest.approx((base[0] * f, base[1] * f))
        for g in plain.dense_opt.param_groups:
            g["lr"] = base[0] * f
        next(iter(plain.embeddings[0].groups.values())).store.optimizer.lr = base[1] * f
        plain.train_step(batch)
    a, b = snapshot(scheduled), snapshot(plain)
    for (spec, w, st), (_, w2, st2) in zip(a["shards"], b["shards"], strict=True):
        torch.testing.assert_close(w, w2, rtol=0, atol=0, msg=spec.table)
        for k in st:
            torch.testing.assert_close(st[k], st2[k], rtol=0, atol=0)
    for k, v in a["dense"].items():
        torch.testing.assert_close(v, b["dense"][k], rtol=0, atol=0, msg=k)


def test_learning_rates_are_logged(tmp_path):
    cfg = make_cfg("none", "sgd", 1)
    cfg.train.steps, cfg.train.log_every, cfg.eval.batches = 4, 1, 1
    s = cfg.optim.schedule
    s.warmup_steps, s.decay_start, s.decay_steps, s.end_factor = 2, 2, 2, 0.0
    Trainer(cfg, init_distributed("cpu"), tmp_path).fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["lr/sparse"] for r in train] == pytest.approx(
        [cfg.optim.sparse.lr * f for f in (0.5, 1.0, 0.25, 0.0)]
    )
    assert [r["lr/dense"] for r in train] == pytest.approx(
        [cfg.optim.dense.lr * f for f in (0.5, 1.0, 0.25, 0.0)]
    )
