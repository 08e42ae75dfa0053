"""The next-item softmax: at every position of every sequence, a softmax over the global batch's
target items plus uniform negatives, logQ-corrected — the retrieval task's loss
(hybridrec.train.retrieval.retrieval_loss) with one query per position.

    objective = next_item_objective(cfg, group, windows, num_items, batch, seed, device)
    neg = objective.negatives(step)                       # [M] item rows, same on every rank
    loss = next_item_softmax_loss(hidden, rows(targets), targets, mask,
                                  rows(neg), neg, group=group, log_q=objective.log_q,
                                  temperature=cfg.temperature)

Shapes as hybridrec.model.next_item: hidden, positives [B, L, D]; target_ids [B, L]; mask
[B, L] (the positions that train). Each masked position is one row of retrieval_loss: its
query is hidden[b, i], its positive the row of target_ids[b, i]; the candidates are every
masked position's target of every rank (gathered with their gradients) and the M negatives
[M, D] (ids [M]). A candidate with the row's own target id elsewhere in the batch is not a
negative (`remove_accidental_hits`). Ranks hold different numbers of masked positions, and
retrieval_loss needs the same rows everywhere: each rank pads its positions to the largest
count (padded rows: `valid` False, no loss, no candidate), and the loss is the sum over
positions divided by (global count / W), so the ranks' mean is the one-process mean over
the global batch's positions (hybridrec.model.next_item, Means).

logQ (`next_item_objective`): the retrieval task's log(B p_j + M / N), with p_j item j's
share of the training targets and B the expected number of training positions in a global
batch of `batch` sequences (the mean positions per training window times `batch`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from hybridrec.config.schema import RetrievalConfig
from hybridrec.distributed.comm import all_gather_rows, all_reduce_sum, world_size
from hybridrec.model.next_item import sampled_bce_loss
from hybridrec.train.retrieval import RetrievalObjective, retrieval_loss


def next_item_softmax_loss(
    hidden: torch.Tensor,
    positives: torch.Tensor,
    target_ids: torch.Tensor,
    mask: torch.Tensor,
    negatives: torch.Tensor | None = None,
    negative_ids: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    log_q: torch.Tensor | None = None,
    remove_accidental_hits: bool = True,
) -> torch.Tensor:
    """This rank's share of the mean softmax loss over every position of the global batch
    (module docstring). negatives [M, D] and negative_ids [M] (the same on every rank) or
    None; log_q [item rows] (indexed by item id) or None. Collective over `group`."""
    d = hidden.shape[-1]
    flat = mask.reshape(-1)
    picked = torch.nonzero(flat).squeeze(1)
    count = torch.tensor([picked.numel()], dtype=torch.int64, device=hidden.device)
    counts = all_gather_rows(count, group, name="next_item_positions")
    rows = int(counts.max())
    valid = torch.arange(rows, device=hidden.device) < picked.numel()
    pick = torch.cat([picked, picked.new_zeros(rows - picked.numel())])
    query = hidden.reshape(-1, d)[pick]
    candidates = positives.reshape(-1, d)[pick]
    items = target_ids.reshape(-1)[pick].clamp(min=0)
    if negatives is not None:
        assert negative_ids is not None, "negatives need their ids"
        candidates = torch.cat([candidates, negatives.to(candidates.dtype)])
        items = torch.cat([items, negative_ids.to(items)])
    return retrieval_loss(
        query,
        candidates,
        items,
        group=group,
        temperature=temperature,
        log_q=None if log_q is None else log_q[items],
        remove_accidental_hits=remove_accidental_hits,
        valid=valid,
        denominator=max(float(counts.sum()), 1.0) / world_size(group),  # none: a zero loss
    )


def next_item_objective(
    cfg: RetrievalConfig,
    group: dist.ProcessGroup | None,
    windows: np.ndarray,
    num_items: int,
    batch: int,
    seed: int,
    device: torch.device,
) -> RetrievalObjective:
    """The retrieval task's objective bound to next-item training (module docstring, logQ):
    its `log_q` [num_items] and `negatives(step)` serve next_item_softmax_loss. windows
    [U, L + 1]: the training sequences (hybridrec.data.sequences.LeaveOneOut.train_windows;
    targets are their events after the first); batch: sequences per global batch."""
    targets = windows[:, 1:]
    trained = targets[(windows[:, :-1] >= 0) & (targets >= 0)]
    counts = np.bincount(trained, minlength=num_items).astype(np.int64)
    positions = batch * len(trained) / max(len(windows), 1)
    return RetrievalObjective(
        cfg,
        group,
        "item",
        counts,
        np.arange(num_items, dtype=np.int64),
        max(1, round(positions)),
        seed,
        device,
    )


class NextItemTraining:
    """model.task=next_item's loss in the trainer (train.next_item.loss): `bce`, SASRec's
    sampled binary cross-entropy against the data's per-position negatives (the model's
    NextItemOutputs.negatives [B, L, N, D]); or `softmax`, over every rank's target items and
    train.retrieval.negatives uniform ones, logQ-corrected (next_item_softmax_loss). Either is
    a mean over every training position of the global batch, so the ranks' mean loss is one
    process's (the positions are counted over the ranks: one small all-reduce per step)."""

    def __init__(
        self,
        loss: str,
        cfg: RetrievalConfig,
        group: dist.ProcessGroup | None,
        windows: np.ndarray,
        num_items: int,
        batch: int,
        seed: int,
        device: torch.device,
    ) -> None:
        self.loss, self.cfg, self.group = loss, cfg, group
        self.retrieval = None
        if loss == "softmax":
            self.retrieval = next_item_objective(
                cfg, group, windows, num_items, batch, seed, device
            )

    def negatives(self, step: int) -> torch.Tensor | None:
        """Training step `step`'s uniform negatives [M] (softmax; the same on every rank)."""
        return self.retrieval.negatives(step) if self.retrieval is not None else None

    def __call__(self, out) -> torch.Tensor:  # noqa: ANN001 - hybridrec.model.sequential.NextItemOutputs
        if self.retrieval is not None:
            return next_item_softmax_loss(
                out.hidden, out.positives, out.target_ids, out.mask, out.negatives,
                out.negative_ids, group=self.group, temperature=self.cfg.temperature,
                log_q=self.retrieval.log_q,
                remove_accidental_hits=self.cfg.remove_accidental_hits,
            )  # fmt: skip
        if out.negatives is None or out.negatives.dim() != 4:
            raise ValueError(
                "train.next_item.loss=bce needs the model's per-position negatives [B, L, N, D] "
                "(data=sequences gives the `neg` feature when train.next_item.negatives > 0)"
            )
        count = out.mask.sum().to(torch.float64).view(1)
        all_reduce_sum(count, self.group, name="next_item_positions")
        denominator = float(count) / world_size(self.group)
        return sampled_bce_loss(out.hidden, out.positives, out.negatives, out.mask, denominator)
