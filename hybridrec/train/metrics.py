"""Evaluation metrics over a whole split: exact ROC AUC, log loss, accuracy."""

from __future__ import annotations

import math

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


def eval_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    return {
        "auc": roc_auc(logits, labels),
        "logloss": log_loss(logits, labels),
        "accuracy": accuracy(logits, labels),
    }
