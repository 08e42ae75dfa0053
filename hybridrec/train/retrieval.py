"""The retrieval loss: a softmax over the global batch's items, equal to one process at any
world size (model.task=retrieval; Yi et al., "Sampling-bias-corrected neural modeling for
large corpus item recommendations", RecSys 2019).

    loss = hybridrec.retrieval_loss(query, candidates, item_ids, group=group,
                                    temperature=0.05, log_q=log_q)

Rank r holds b rows: query [b, D] and its rows' items' vectors, candidates [b, D] (row i's
positive is candidates[i]), then M extra negatives' vectors, the same on every rank
(candidates [b + M, D]). The positives of every rank are gathered (gather_with_grad: the
backward sums each rank's gradient into the owner), so each row is scored against all W * b
items of the global batch plus the M negatives:

    logits[i, j] = <query_i, candidate_j> / temperature - log_q[j]
    loss_r = mean over its b rows of cross_entropy(logits[i], global index of row i)

The mean of the ranks' losses is the one-process loss on the global batch, and gradients are
its gradients (hybridrec.distributed.gather). `log_q[j]`: the log of how often item j is
expected among the candidates (logQ correction), so that popular items, which are
everyone's negatives, are not pushed down for it; `remove_accidental_hits`: another row's copy
of row i's own item is not one of its negatives. Scores are computed in fp32.

`RetrievalObjective` is the trainer's binding (train.retrieval.*): log_q from the training
data's item counts, log(B p_j + M / N) (B the global batch, p_j item j's share of the
training rows, M negatives drawn uniformly from the N catalogue items: the expected count of
j among the candidates; with M = 0 a constant away from Yi et al.'s log p_j), and the M
negatives of each step (a generator seeded by the run's seed and the step: the same on every
rank and on a resume).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hybridrec.config.schema import RetrievalConfig
from hybridrec.distributed.comm import all_gather_rows, world_size
from hybridrec.distributed.gather import gather_with_grad
from hybridrec.types import KeyedIds


def retrieval_loss(
    query: torch.Tensor,
    candidates: torch.Tensor,
    item_ids: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    log_q: torch.Tensor | None = None,
    remove_accidental_hits: bool = False,
    valid: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's mean softmax loss over the global batch's items (module docstring).

    query [b, D]; candidates [b + M, D]: the b rows' positives, then M negatives shared by
    every rank; item_ids [b + M]: their item ids; log_q [b + M] or None: each candidate's
    correction. Every rank passes the same b and M (collective over `group`).

    Padded rows (next-item training, hybridrec.train.next_item): valid [b] bool marks the
    real rows; the others add no loss and their items are no row's candidate. The loss is
    then the sum over valid rows divided by `denominator` (None: this rank's valid rows)."""
    b = query.shape[0]
    m = candidates.shape[0] - b
    if m < 0 or item_ids.shape != (b + m,) or (log_q is not None and log_q.shape != (b + m,)):
        raise ValueError(
            f"retrieval_loss: query [{b}, D] needs candidates [{b} + M, D] with item_ids and "
            f"log_q [{b} + M]; got candidates {list(candidates.shape)}, item_ids "
            f"{list(item_ids.shape)}, log_q {None if log_q is None else list(log_q.shape)}"
        )
    rank = dist.get_rank(group) if world_size(group) > 1 else 0
    device = query.device
    with torch.autocast(device.type, enabled=False):
        positives = gather_with_grad(candidates[:b].float(), group, name="retrieval_items")
        pool = torch.cat([positives, candidates[b:].float()])
        # ids (and corrections) of every rank's positives: float64 holds ids < 2^53 exactly
        side = [item_ids[:b].double()] + ([log_q[:b].double()] if log_q is not None else [])
        if valid is not None:
            side.append(valid.double())
        gathered = all_gather_rows(torch.stack(side, 1), group, name="retrieval_ids")
        pool_ids = torch.cat([gathered[:, 0].long(), item_ids[b:].long()])
        logits = query.float() @ pool.T / temperature
        if log_q is not None:
            logits = logits - torch.cat([gathered[:, 1], log_q[b:].double()]).float()
        target = rank * b + torch.arange(b, device=device)
        if remove_accidental_hits:
            hits = pool_ids.unsqueeze(0) == item_ids[:b].long().unsqueeze(1)
            hits[torch.arange(b, device=device), target] = False
            logits = logits.masked_fill(hits, float("-inf"))
        if valid is None and denominator is None:
            return nn.functional.cross_entropy(logits, target)
        rows = torch.ones(b, dtype=torch.bool, device=device) if valid is None else valid
        if valid is not None:  # padded rows' items are no one's candidate
            padded = torch.cat(
                [gathered[:, -1] == 0, torch.zeros_like(item_ids[b:], dtype=torch.bool)]
            )
            logits = logits.masked_fill(padded.unsqueeze(0), float("-inf"))
        total = nn.functional.cross_entropy(logits[rows], target[rows], reduction="sum")
        return total / (rows.sum().clamp(min=1) if denominator is None else denominator)


def _step_seed(seed: int, step: int) -> int:
    digest = hashlib.sha256(f"retrieval-negatives/{seed}/{step}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


class RetrievalObjective:
    """model.task=retrieval's loss in the trainer (train.retrieval.*, module docstring).

    `item_counts` [item rows]: the training rows of each item (None: unknown, refused with
    logq); `catalogue` [N]: the item ids negatives are drawn from; `batch_size`: the global
    batch."""

    def __init__(
        self,
        cfg: RetrievalConfig,
        group: dist.ProcessGroup | None,
        item_feature: str,
        item_counts: np.ndarray | None,
        catalogue: np.ndarray,
        batch_size: int,
        seed: int,
        device: torch.device,
    ) -> None:
        self.cfg, self.group, self.item_feature = cfg, group, item_feature
        self.seed, self.device = seed, device
        self.catalogue = torch.from_numpy(catalogue)
        self.log_q: torch.Tensor | None = None
        if cfg.logq:
            if item_counts is None:
                raise ValueError(
                    "train.retrieval.logq=true needs the training data's item counts, and "
                    "this dataset records none (re-run hybridrec-preprocess); or set "
                    "train.retrieval.logq=false"
                )
            # an item the counts never met counts once: a finite correction
            counts = torch.from_numpy(np.maximum(item_counts, 1)).double()
            expected = batch_size * counts / float(item_counts.sum())
            expected += cfg.negatives / len(catalogue)
            self.log_q = expected.log().float().to(device)

    def negatives(self, step: int) -> torch.Tensor | None:
        """Step `step`'s extra negatives [M] (item ids), the same on every rank; None if M=0."""
        if not self.cfg.negatives:
            return None
        g = torch.Generator().manual_seed(_step_seed(self.seed, step))
        picks = torch.randint(len(self.catalogue), (self.cfg.negatives,), generator=g)
        return self.catalogue[picks].to(self.device)

    def __call__(self, outputs: Any, ids: KeyedIds, negatives: torch.Tensor | None) -> torch.Tensor:
        """The loss of a retrieval model's outputs (query, candidates) on this rank's ids."""
        if not (isinstance(outputs, tuple | list) and len(outputs) == 2):
            raise ValueError(
                "model.task=retrieval: the model's forward must return (query [b, D], "
                f"candidates [b + M, D]), got {type(outputs).__name__}"
            )
        query, candidates = outputs
        items = ids.select([self.item_feature], [1]).view(-1)
        if negatives is not None:
            items = torch.cat([items, negatives.to(items.device)])
        log_q = None if self.log_q is None else self.log_q[items.to(self.log_q.device)]
        return retrieval_loss(
            query,
            candidates,
            items,
            group=self.group,
            temperature=self.cfg.temperature,
            log_q=log_q,
            remove_accidental_hits=self.cfg.remove_accidental_hits,
        )
