"""Next-item prediction at every position of a sequence: the sampled binary cross-entropy
objective of SASRec, and the helpers both objectives and evaluation share.

Shapes: hidden [B, L, D] from a sequence encoder (hybridrec.model.sasrec.SASRec,
hybridrec.model.hstu.HSTU); hidden[b, i] predicts event i + 1 of row b, whose item row is
positives[b, i] ([B, L, D]); mask [B, L] bool says which positions train (an input event
with a next event: target ids >= 0). One sequence feature of length L + 1 gives both with one
lookup (`shift`). The softmax over in-batch items with logQ correction, which gathers every
rank's items, is hybridrec.train.next_item.next_item_softmax_loss (it needs collectives,
which this package never imports).

Means over positions, and several ranks: each loss is the sum over the masked positions
divided by `denominator` (default: this call's count of masked positions, the mean SASRec
trains). On W ranks, whose counts differ, pass denominator = (global count) / W so that the
mean of the ranks' losses (what DDP's gradient averaging and the embedding exchanges' 1/W
give) is the one-process mean over every position of the global batch.
"""

from __future__ import annotations

import torch
from torch import nn


def shift(rows: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(input rows [B, L, D], input mask [B, L], target rows [B, L, D], target ids [B, L],
    train mask [B, L]) of one looked-up sequence of L + 1 events: rows [B, L + 1, D], ids
    [B, L + 1] (PAD -1). Position i's input is event i and its target event i + 1; it trains
    when both are events."""
    mask = ids >= 0
    inputs, targets = rows[:, :-1], rows[:, 1:]
    target_ids = ids[:, 1:]
    return inputs, mask[:, :-1], targets, target_ids, mask[:, :-1] & (target_ids >= 0)


def last_states(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, D]: each row's hidden state at its last event (the user's state for ranking its
    next item). ValueError for a row without events (an empty history cannot be ranked)."""
    lengths = mask.sum(1)
    if bool((lengths == 0).any()):
        row = int(torch.nonzero(lengths == 0)[0, 0])
        raise ValueError(
            f"next-item model: row {row} of the batch has an empty history; every ranked "
            "user needs at least one event"
        )
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]


def _mean(total: torch.Tensor, mask: torch.Tensor, denominator: float | torch.Tensor | None):  # noqa: ANN202
    if denominator is None:
        denominator = mask.sum().clamp(min=1)
    return total / denominator


def sampled_bce_loss(
    hidden: torch.Tensor,
    positives: torch.Tensor,
    negatives: torch.Tensor,
    mask: torch.Tensor,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """SASRec's objective: at each masked position, -log sigmoid(<h, pos>) - sum over its N
    negatives of log(1 - sigmoid(<h, neg_n>)), summed over positions and divided by
    `denominator` (module docstring). hidden, positives [B, L, D]; negatives [B, L, N, D]
    (N = 1: SASRec's one negative per position, where the sum equals the paper's two means);
    mask [B, L] bool. Computed in fp32."""
    if negatives.dim() != 4 or negatives.shape[:2] != hidden.shape[:2]:
        raise ValueError(
            f"sampled_bce_loss: negatives must be [B, L, N, D] for hidden {list(hidden.shape)}; "
            f"got {list(negatives.shape)}"
        )
    h = hidden.float()
    pos = (h * positives.float()).sum(-1)  # [B, L]
    neg = torch.einsum("bld,blnd->bln", h, negatives.float())  # [B, L, N]
    per_position = nn.functional.softplus(-pos) + nn.functional.softplus(neg).sum(-1)
    total = torch.where(mask, per_position, torch.zeros_like(per_position)).sum()
    return _mean(total, mask, denominator)


def uniform_negatives(
    shape: tuple[int, ...], num_items: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Item rows uniform in [0, num_items), of `shape` (SASRec samples one per position;
    it also avoids the user's own items, which at 1 in num_items per draw changes little)."""
    return torch.randint(num_items, shape, generator=generator)
