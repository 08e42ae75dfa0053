from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from hybridrec.config.schema import EvalConfig
from hybridrec.train.metrics import (
    accuracy,
    calibration,
    eval_metrics,
    log_loss,
    normalized_entropy,
    reached_target,
    roc_auc,
)


def _brute_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auc_exact_with_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (300,), generator=g).float()  # many ties
    labels = (torch.rand(300, generator=g) < 0.3).float()
    assert math.isclose(
        roc_auc(scores, labels), _brute_auc(scores.tolist(), labels.tolist()), rel_tol=1e-12
    )


def test_auc_edge_cases():
    assert roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    assert roc_auc(torch.tensor([0.9, 0.1]), torch.tensor([0.0, 1.0])) == 0.0
    assert math.isnan(roc_auc(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 1.0])))


def test_logloss_and_accuracy():
    logits, labels = torch.tensor([0.0, 2.0, -1.0]), torch.tensor([1.0, 1.0, 1.0])
    assert math.isclose(
        log_loss(logits, labels),
        float(torch.nn.functional.softplus(-logits.double()).mean()),
        rel_tol=1e-12,
    )
    assert math.isclose(accuracy(logits, labels), 1 / 3)


def test_normalized_entropy_is_one_for_the_base_rate_and_lower_for_a_better_model():
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])  # base rate 1/4
    base_logit = math.log(0.25 / 0.75)
    assert math.isclose(normalized_entropy(torch.full((4,), base_logit), labels), 1.0)
    better = torch.tensor([1.0, -2.0, -2.0, -2.0])
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert math.isclose(normalized_entropy(better, labels), log_loss(better, labels) / entropy)
    assert normalized_entropy(better, labels) < 1.0
    assert math.isnan(normalized_entropy(better, torch.ones(4)))


def test_calibration_is_predicted_over_actual_clicks():
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    logits = torch.tensor([0.0, 0.0, 0.0, 0.0])  # predicts 0.5 each: 2 clicks of 2
    assert math.isclose(calibration(logits, labels), 1.0)
    three = torch.full((4,), math.log(3.0), dtype=torch.float64)  # predicts 0.75 each
    assert math.isclose(calibration(three, labels), 1.5)
    assert math.isnan(calibration(logits, torch.zeros(4)))
    assert set(eval_metrics(logits, labels, "binary")) == {
        "auc",
        "logloss",
        "accuracy",
        "ne",
        "calibration",
    }


def test_regression_metrics_are_mse_rmse_and_mae():
    out = torch.tensor([1.5, -0.25, 3.0, 2.0])
    y = torch.tensor([1.0, 0.0, 4.5, 2.0])
    m = eval_metrics(out, y, "regression")
    assert set(m) == {"loss", "rmse", "mae"}
    err = out.numpy().astype(np.float64) - y.numpy()
    assert m["loss"] == pytest.approx(np.mean(err**2), rel=1e-15)  # (0.25+0.0625+2.25+0)/4
    assert m["rmse"] == pytest.approx(math.sqrt(2.5625 / 4), rel=1e-15)
    assert m["mae"] == pytest.approx((0.5 + 0.25 + 1.5 + 0.0) / 4, rel=1e-15)


def test_stop_targets_read_their_metric_in_its_direction():
    assert reached_target(EvalConfig(target_auc=0.8), {"auc": 0.79}) is None
    assert reached_target(EvalConfig(target_auc=0.8), {"auc": 0.8}).startswith("eval.target_auc")
    assert reached_target(EvalConfig(target_rmse=0.9), {"rmse": 0.91}) is None
    assert reached_target(EvalConfig(target_rmse=0.9), {"rmse": 0.9}).startswith("eval.target_r")
    assert reached_target(EvalConfig(), {"auc": 1.0, "rmse": 0.0}) is None
