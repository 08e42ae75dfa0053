"""SIGTERM / SIGUSR1 with checkpoint.dir: every rank saves a checkpoint at the next logging
step and stops; the same command resumes and ends with the weights of a run never stopped."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from hybridrec.distributed import DistEnv, init_distributed
from hybridrec.train.checkpoint import list_checkpoints
from hybridrec.train.trainer import Trainer
from tests.distributed.harness import spawn
from tests.equivalence import make_cfg, snapshot


def _cfg(ck_dir, mode="none", world=1, steps=12):
    cfg = make_cfg(mode, "adam", world)
    cfg.checkpoint.dir, cfg.train.steps, cfg.train.log_every = ck_dir, steps, 4
    cfg.eval.every, cfg.eval.batches = 0, 1
    return cfg


def _signal_at(trainer: Trainer, at_step: int, sig: int) -> None:
    """Make this process receive `sig` right after step `at_step`."""
    step = trainer.train_step

    def wrapped(*args, **kwargs):
        loss = step(*args, **kwargs)
        if trainer.step == at_step:
            os.kill(os.getpid(), sig)
        return loss

    trainer.train_step = wrapped


def test_sigterm_saves_at_the_next_log_step_and_resume_matches(tmp_path):
    env = init_distributed("cpu")
    torch.set_num_threads(1)
    before = signal.getsignal(signal.SIGTERM)
    t = Trainer(_cfg(str(tmp_path / "ck")), env)
    _signal_at(t, 5, signal.SIGTERM)
    result = t.fit()
    assert result["preempted"] and t.step == 8  # the next logging step after 5
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step_8"]
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored
    resumed = Trainer(_cfg(str(tmp_path / "ck")), env)
    assert not resumed.fit()["preempted"] and resumed.step == 12
    straight = Trainer(_cfg(str(tmp_path / "other")), env)
    straight.fit()
    assert _bitwise_equal(resumed, straight)


def _bitwise_equal(a: Trainer, b: Trainer) -> bool:
    """Every shard's rows and optimizer state and every dense weight, bit for bit (the same
    world size and plan reproduce exactly, across resumes too; other plans match to float32
    round-off per step, which tests/distributed/test_equivalence.py checks)."""
    sa, sb = snapshot(a), snapshot(b)
    for (_, w, st), (_, w2, st2) in zip(sa["shards"], sb["shards"], strict=True):
        if not torch.equal(w, w2) or any(not torch.equal(st[k], st2[k]) for k in st):
            return False
    return all(torch.equal(v, sb["dense"][k]) for k, v in sa["dense"].items())


def _resume_vs_straight(env: DistEnv, root: str) -> bool:
    torch.set_num_threads(1)
    first = Trainer(_cfg(f"{root}/ck", "column_wise", env.world_size, steps=4), env)
    first.fit()  # saves step_4
    resumed = Trainer(_cfg(f"{root}/ck", "column_wise", env.world_size, steps=8), env)
    resumed.fit()
    straight = Trainer(_cfg(f"{root}/other", "column_wise", env.world_size, steps=8), env)
    straight.fit()
    return resumed.step == straight.step == 8 and _bitwise_equal(resumed, straight)


@pytest.mark.slow
def test_same_world_and_plan_resume_bit_for_bit(tmp_path):
    assert spawn(2, _resume_vs_straight, str(tmp_path)) == [True, True]


def _rank_signalled(env: DistEnv, ck_dir: str):
    t = Trainer(_cfg(ck_dir, "row_wise", env.world_size), env)
    if env.rank == 1:
        _signal_at(t, 6, signal.SIGUSR1)  # only rank 1 is told
    return t.fit()["preempted"], t.step


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    ck = str(tmp_path / "ck")
    assert spawn(3, _rank_signalled, ck) == [(True, 8)] * 3
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step_8"]


def test_without_a_checkpoint_dir_signals_keep_their_default(tmp_path):
    cfg = _cfg(None, steps=2)
    before = signal.getsignal(signal.SIGTERM)
    seen = []
    t = Trainer(cfg, init_distributed("cpu"))
    step = t.train_step
    t.train_step = lambda *a, **k: (seen.append(signal.getsignal(signal.SIGTERM)), step(*a, **k))[1]
    assert not t.fit()["preempted"]
    assert seen == [before, before]


def test_ctrl_c_saves_like_sigterm_and_a_later_second_one_aborts(tmp_path, monkeypatch):
    env = init_distributed("cpu")
    t = Trainer(_cfg(str(tmp_path / "ck")), env)
    _signal_at(t, 5, signal.SIGINT)
    result = t.fit()
    assert result["preempted"] and t.step == 8
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step_8"]
    from hybridrec.train import preemption

    clock = [100.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    with preemption.PreemptionGuard(enabled=True) as guard:
        os.kill(os.getpid(), signal.SIGINT)
        clock[0] += 0.5  # the same Ctrl-C passed on by a launcher: still one request
        os.kill(os.getpid(), signal.SIGINT)
        assert guard.received == "SIGINT"
        clock[0] += 5.0  # a second Ctrl-C, later: stop now
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
