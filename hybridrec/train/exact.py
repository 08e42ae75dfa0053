"""The trainer's step in exact mode (train.exact: hybridrec.exact, docs/exact.md).

`forward` runs the step's lookups and the model per micro-shard (hybridrec.exact.exact_forward)
and hands the trainer the whole global batch's outputs, batch and ids, gathered on every rank:
model.task's loss (hybridrec.train.objective) then runs on them as one process's would, with no
collective inside (next_item's position count is of the gathered batch: its objective is
built without the group in exact mode). Only what the loss reads is gathered: the labels, and
the batch's dense features and ids only for a model that defines its own loss (model.task's
losses and next_item's read the outputs and labels alone; a Batch then carries 0 rows of
dense and ids, so a read of them fails loudly). `backward(loss)` finishes the step.
Evaluation scores `eval_chunk` samples per forward, an eval micro-shard: the shapes one
process sees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hybridrec.config import Config
from hybridrec.distributed.env import DistEnv
from hybridrec.exact import ExactForward, exact_forward, exact_tables
from hybridrec.types import Batch, KeyedIds


class ExactTraining:
    """Exact mode's forward and backward for the trainer (module docstring); `keyed(ids)`:
    a batch's ids by feature; `own_loss`: whether the model defines its own loss, which may
    read the batch's dense features and ids (then they are gathered too: Objective.own_loss)."""

    def __init__(
        self,
        cfg: Config,
        env: DistEnv,
        model: nn.Module,
        keyed: Callable[[torch.Tensor], KeyedIds],
        own_loss: bool,
    ) -> None:
        self.model, self.keyed, self.inputs = model, keyed, own_loss
        self.eval_chunk = cfg.eval.batch_size // cfg.train.exact_shards
        local = cfg.train.batch_size // env.world_size
        hosted = any(s.prefetches for _, s in exact_tables(model))
        if hosted and self.eval_chunk > local:
            raise ValueError(
                f"train.exact=true with host-memory tables: an eval micro-shard of "
                f"eval.batch_size / train.exact_shards = {self.eval_chunk} samples exceeds the "
                f"caches' {local} (train.batch_size / world size); lower eval.batch_size"
            )
        self._step: ExactForward | None = None

    def forward(
        self, dense: torch.Tensor, batch: Batch, keyed: KeyedIds, extra: dict[str, Any]
    ) -> tuple[Any, Batch, KeyedIds]:
        """This rank's batch -> (the global batch's outputs, its batch, its ids by feature;
        without `inputs`, 0 rows of dense and ids)."""
        if self.inputs:
            step = exact_forward(self.model, dense, keyed, dense, batch.ids, batch.labels, **extra)
            dense_all, ids_all, labels_all = step.targets
        else:
            step = exact_forward(self.model, dense, keyed, batch.labels, **extra)
            dense_all, ids_all, (labels_all,) = dense[:0], batch.ids[:0], step.targets
        self._step = step
        return step.outputs, Batch(dense_all, ids_all, labels_all), self.keyed(ids_all)

    def backward(self, loss: torch.Tensor) -> None:
        """The step's backward from its loss (rows updated, dense .grad set)."""
        step, self._step = self._step, None
        assert step is not None, "ExactTraining.backward without its forward"
        step.backward(loss)
