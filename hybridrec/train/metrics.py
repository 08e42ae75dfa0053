"""Evaluation metrics over a whole split, by model.task: binary reports exact ROC AUC, log loss,
accuracy, normalized entropy and calibration (the last two as in recommender practice, e.g.
TorchRec's NE and calibration metrics); regression reports `loss` (mean squared error), `rmse`
and `mae`. Every metric takes the model's raw outputs [N] and labels [N] of the evaluated
samples (padding already masked out) and is computed in float64 on the CPU.

Retrieval reports `hr@K`, `recall@K` and `ndcg@K` for each K of eval.topk (TopKMetrics), from
each user's ranked top-K list over the whole catalogue (hybridrec.train.topk), averaged over
users: HR@K = 1 when any of the user's positives is in its top K; Recall@K = the share of its
positives in the top K; NDCG@K = sum over hits at rank j (from 0) of 1/log2(j + 2), divided
by the same sum of a perfect list (min(K, positives) hits at the top). With one positive per
user (leave-one-out) Recall@K = HR@K and NDCG@K = 1/log2(rank + 2) when rank < K.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC (Mann-Whitney U with tied scores sharing their average rank).

    scores [N] any float (logits or probabilities), labels [N] in {0, 1}. NaN if a class is absent.
    """
    scores = scores.detach().double().flatten().cpu()
    labels = labels.detach().flatten().cpu().bool()
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    uniq, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    avg_rank = ends - (counts.double() - 1) / 2  # 1-based average rank of each distinct score
    rank_sum = avg_rank[inverse][labels].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of logits [N] against labels [N]."""
    return torch.nn.functional.binary_cross_entropy_with_logits(
        logits.double().cpu(), labels.double().cpu()
    ).item()


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of samples whose thresholded prediction (logit > 0) equals the label."""
    return ((logits.cpu() > 0).float() == labels.cpu().float()).double().mean().item()


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Log loss divided by the entropy of the base rate p = mean(labels): 1.0 is a model that
    always predicts p, lower is better. Comparable across datasets with different click
    rates, where raw log loss is not. NaN if every label is equal (no entropy to beat)."""
    p = labels.double().mean().item()
    if p <= 0.0 or p >= 1.0:
        return math.nan
    base = -(p * math.log(p) + (1.0 - p) * math.log(1.0 - p))
    return log_loss(logits, labels) / base


def calibration(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Predicted clicks over actual clicks, sum(sigmoid(logits)) / sum(labels): 1.0 is
    calibrated, above 1 over-predicts. NaN without positive labels."""
    positives = labels.double().sum().item()
    if positives == 0.0:
        return math.nan
    return torch.sigmoid(logits.detach().double().cpu()).sum().item() / positives


def binary_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    return {
        "auc": roc_auc(logits, labels),
        "logloss": log_loss(logits, labels),
        "accuracy": accuracy(logits, labels),
        "ne": normalized_entropy(logits, labels),
        "calibration": calibration(logits, labels),
    }


def regression_metrics(outputs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Mean squared error (`loss`, the training loss), its root and the mean absolute error."""
    err = outputs.detach().double().cpu() - labels.detach().double().cpu()
    mse = err.square().mean().item()
    return {"loss": mse, "rmse": math.sqrt(mse), "mae": err.abs().mean().item()}


_METRICS: dict[str, Callable[[torch.Tensor, torch.Tensor], dict[str, float]]] = {
    "binary": binary_metrics,
    "regression": regression_metrics,
}


def eval_metrics(outputs: torch.Tensor, labels: torch.Tensor, task: str) -> dict[str, float]:
    """The metrics of model.task `task` over outputs [N] and labels [N]."""
    return _METRICS[task](outputs, labels)


# The eval metrics a stop target reads: eval.<key>, the metric, and whether higher is better
TARGETS = (("target_auc", "auc", True), ("target_rmse", "rmse", False))


def reached_target(eval_cfg: Any, metrics: dict[str, float]) -> str | None:
    """`eval.<target>=<value>` when `metrics` reach a set stop target (eval.target_auc: AUC at
    or above it; eval.target_rmse: RMSE at or below it), else None."""
    for key, metric, higher in TARGETS:
        target = getattr(eval_cfg, key)
        if target is None or metric not in metrics:
            continue
        value = metrics[metric]
        if (value >= target) if higher else (value <= target):
            return f"eval.{key}={target:g} ({metric} {value:.5f})"
    return None


class TopKMetrics:
    """Running sums of HR@K, Recall@K and NDCG@K over users (module docstring), float64."""

    def __init__(self, ks: list[int]) -> None:
        self.ks = sorted(set(int(k) for k in ks))
        self.users = 0
        self.sums = {f"{m}@{k}": 0.0 for k in self.ks for m in ("hr", "recall", "ndcg")}

    def add(self, hits: torch.Tensor, positives: torch.Tensor) -> None:
        """hits [Q, K_max] bool: whether each user's item at each rank is a positive;
        positives [Q]: each user's number of positives (>= 1)."""
        hits, positives = hits.cpu(), positives.cpu().double()
        discount = 1.0 / torch.log2(torch.arange(hits.shape[1], dtype=torch.float64) + 2)
        gains = hits.double() * discount
        ideal = discount.cumsum(0)
        for k in self.ks:
            found = hits[:, :k].sum(1).double()
            best = ideal[(positives.clamp(max=k) - 1).long()]
            self.sums[f"hr@{k}"] += float((found > 0).double().sum())
            self.sums[f"recall@{k}"] += float((found / positives).sum())
            self.sums[f"ndcg@{k}"] += float((gains[:, :k].sum(1) / best).sum())
        self.users += hits.shape[0]

    def result(self) -> dict[str, float]:
        """The means over the users added ({} when none)."""
        if not self.users:
            return {}
        return {k: v / self.users for k, v in self.sums.items()}
