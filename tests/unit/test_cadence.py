"""The training loop's due rules (hybridrec.train.cadence), its stop signal agreement
(PreemptionGuard.agreed) and the pipeline's look-ahead depth, on their own: which steps log,
save and evaluate, how a stop signal or a reached target changes a step's plan, and that the
planner's host-cache floor follows LOOK_AHEAD. The loop itself is tested through fit() in
tests/train (test_preemption, test_checkpoint*, ...) and tests/unit/test_train_e2e.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from hybridrec.planner import CachePolicy
from hybridrec.train.cadence import Cadence, Due, Every, Window
from hybridrec.train.pipeline import LOOK_AHEAD, staged_step
from hybridrec.train.preemption import PreemptionGuard


def _due_steps(rule: Every, last: int) -> list[int]:
    return [s for s in range(1, last + 1) if rule.due(s, last)]


@pytest.mark.parametrize(
    "period,last,want",
    [
        (3, 10, [3, 6, 9, 10]),  # every third step, and the last
        (5, 10, [5, 10]),  # the last is a multiple: once
        (1, 4, [1, 2, 3, 4]),
        (0, 6, [6]),  # 0: only the last step
        (None, 6, [6]),
        (20, 6, [6]),  # a period longer than the run
    ],
)
def test_every_is_due_at_each_multiple_and_the_last_step(period, last, want):
    assert _due_steps(Every(period), last) == want


def _cfg(log_every: int, ck_every: int, eval_every: int) -> SimpleNamespace:
    return SimpleNamespace(
        train=SimpleNamespace(log_every=log_every),
        checkpoint=SimpleNamespace(every=ck_every),
        eval=SimpleNamespace(every=eval_every),
    )


def test_a_cadence_reads_each_rule_from_its_key():
    cadence = Cadence.of(_cfg(log_every=2, ck_every=3, eval_every=4))
    assert _due_steps(cadence.log, 9) == [2, 4, 6, 8, 9]
    assert _due_steps(cadence.save, 9) == [3, 6, 9]
    assert _due_steps(cadence.evaluate, 9) == [4, 8, 9]
    assert cadence.after(6, 9) == Due(log=True, save=True, evaluate=False)
    assert cadence.after(5, 9) == Due(log=False, save=False, evaluate=False)
    assert cadence.after(9, 9) == Due(log=True, save=True, evaluate=True)  # the last: all
    assert not cadence.after(8, 9).stop  # nothing stops a run on schedule before its end


def test_a_stop_signal_saves_skips_evaluation_and_stops():
    plan = Due(log=True, save=False, evaluate=True).on_stop_signal()
    assert plan == Due(log=True, save=True, evaluate=False, stop=True)
    assert plan.restarts_window


def test_a_reached_target_stops_and_keeps_whether_the_step_saved():
    """The loop saves a stopping run unless the step's schedule saved already: on_target
    leaves `save` as it was, for the loop to read."""
    assert Due(log=False, save=False, evaluate=True).on_target() == Due(False, False, True, True)
    assert Due(log=True, save=True, evaluate=True).on_target() == Due(True, True, True, True)


def test_the_throughput_window_restarts_at_evaluations_and_stops_only():
    assert Due(log=False, save=False, evaluate=True).restarts_window
    assert not Due(log=True, save=True, evaluate=False).restarts_window  # a save is training's
    assert Due(log=False, save=True, evaluate=False, stop=True).restarts_window
    window = Window(4)
    steps, seconds = window.span(7)
    assert steps == 3 and seconds >= 0
    window.restart(7)
    assert window.span(9)[0] == 2


def test_the_ranks_agree_on_a_stop_signal_any_of_them_received(caplog):
    guard = PreemptionGuard(enabled=False)
    asked = []

    def nobody(flag: bool) -> bool:
        asked.append(flag)
        return flag

    assert not guard.agreed(nobody, 4) and asked == [False]
    with caplog.at_level(logging.WARNING, logger="hybridrec"):
        assert guard.agreed(lambda flag: True, 6)  # another rank received one
    assert "a stop signal (on another rank) received: saving a checkpoint at step 6" in caplog.text
    guard.received = "SIGTERM"
    assert guard.agreed(nobody, 8) and asked[-1] is True
    assert "SIGTERM received: saving a checkpoint at step 8 and stopping" in caplog.text


def test_the_look_ahead_depth_is_the_pipelines_and_the_cache_floor_follows_it():
    """A batch staged during step n trains at step n + LOOK_AHEAD; a host cache holds the
    rows of the step training and of the LOOK_AHEAD staged ones (planner's CachePolicy floor,
    which cannot import the pipeline)."""
    assert staged_step(1) == 1 + LOOK_AHEAD
    assert CachePolicy().min_batches == LOOK_AHEAD + 1
