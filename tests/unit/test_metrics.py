from __future__ import annotations

import itertools
import math

import torch

from hybridrec.train.metrics import accuracy, log_loss, roc_auc


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
