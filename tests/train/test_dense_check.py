"""NaN or inf dense features are bad input (train.check_ids), named by feature and sample,
never blamed on the learning rates: at once on a single CPU process, deferred (read as 0,
raised at the next check) where an immediate check would cost a sync or a collective."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrec.distributed import init_distributed
from hybridrec.train.dense_check import NonFiniteInputError
from hybridrec.train.health import NonFiniteLossError
from hybridrec.train.trainer import Trainer
from hybridrec.types import Batch
from tests.equivalence import make_cfg


def _trainer(tmp_path=None, nonfinite="error"):
    cfg = make_cfg("none", "rowwise_adagrad", 1)
    cfg.train.nonfinite = nonfinite
    if tmp_path is not None:
        cfg.checkpoint.dir = str(tmp_path)
    return Trainer(cfg, init_distributed("cpu"))


def _poisoned(batch: Batch, sample: int, feature: int, value: float) -> Batch:
    dense = batch.dense.clone()
    dense[sample, feature] = value
    return Batch(dense, batch.ids, batch.labels)


def test_nan_dense_feature_raises_at_once_on_a_cpu_process():
    t = _trainer()
    t.train_step(t.train_batch(0))
    t.step = 1
    with pytest.raises(NonFiniteInputError) as e:
        t.train_step(_poisoned(t.train_batch(1), 17, 4, math.nan))
    msg = str(e.value)
    assert msg.startswith(
        "dense feature 4 is nan at sample 17 of training step 2: bad input data, not a "
        "learning-rate problem; fix or drop that row (train.check_ids checks inputs)"
    )
    assert "\n" not in msg and "optim.dense.lr" not in msg
    assert isinstance(e.value, ValueError)
    assert t.step == 1  # the bad batch was not trained on


def test_finite_values_whose_sum_overflows_pass_the_check():
    """The CPU check sums first (a NaN or inf shows in the sum); a finite batch whose sum
    overflows to inf takes the full check, which finds nothing to report."""
    from hybridrec.distributed import DistEnv
    from hybridrec.train.dense_check import DenseChecker

    check = DenseChecker(DistEnv())
    big = torch.full((8, 3), 3e38)
    assert not torch.isfinite(big.sum()) and check(big, 0) is big
    bad = big.clone()
    bad[6, 2] = math.nan
    with pytest.raises(NonFiniteInputError, match="dense feature 2 is nan at sample 6 "):
        check(bad, 0)


def test_deferred_check_reads_bad_values_as_zero_and_raises_before_the_loss_watch(tmp_path):
    """As on CUDA or several ranks: no sync in the step; the bad value is read as 0 (the step
    equals one on the zeroed batch) and the next check (a save here) raises the input error,
    not NonFiniteLossError, and saves nothing."""
    t, ref = _trainer(tmp_path), _trainer()
    t.dense_checks["train"].defer = True
    batch = t.train_batch(0)
    loss = t.train_step(_poisoned(batch, 5, 3, -math.inf))
    assert torch.equal(loss, ref.train_step(_poisoned(batch, 5, 3, 0.0)))
    for p, q in zip(t.model.parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(p, q)
    t.train_step(_poisoned(t.train_batch(1), 9, 0, math.nan))  # a later one is not reported
    with pytest.raises(NonFiniteInputError) as e:
        t.save()
    assert str(e.value) == (
        "dense feature 3 is -inf at sample 5 of training step 1: bad input data, not a "
        "learning-rate problem; fix or drop that row (train.check_ids checks inputs); the "
        "run stops here"
    )
    assert not list(tmp_path.iterdir())
    t.check_inputs()  # raised once; the record is cleared
    t.check_finite()  # the loss stayed finite: nothing blamed on the learning rates


def test_skip_policy_does_not_skip_bad_input():
    """train.nonfinite=skip drops steps whose loss is not finite; a NaN input is an error."""
    t = _trainer(nonfinite="skip")
    t.dense_checks["train"].defer = True
    nan = _poisoned(t.train_batch(0), 2, 12, math.nan)
    # the deferred check read the NaN as 0, so the loss is finite and the step trains
    t.train_step(nan)
    assert t.skipped == 0
    with pytest.raises(NonFiniteInputError, match="dense feature 12 is nan at sample 2 "):
        t.check_inputs()
    # a NaN loss from elsewhere (a poisoned weight) while a bad input is recorded: the skip
    # branch checks the inputs first
    with torch.no_grad():
        next(iter(t.model.parameters())).fill_(math.nan)
    with pytest.raises(NonFiniteInputError, match="dense feature 12 is nan at sample 2 "):
        t.train_step(nan)
    t.train_step(t.train_batch(1))  # no bad input: a non-finite loss is skipped
    assert t.skipped == 1


def test_checks_off_leaves_the_loss_watch_to_report():
    t = _trainer()
    t.cfg.train.check_ids = False
    t2 = Trainer(t.cfg, init_distributed("cpu"))
    assert t2.dense_checks == {}
    t2.train_step(_poisoned(t2.train_batch(0), 0, 0, math.nan))
    with pytest.raises(NonFiniteLossError, match="check the data \\(train.check_ids=true"):
        t2.check_finite()
