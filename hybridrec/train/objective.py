"""What a training step minimises, and what it passes the model besides the batch.

- The loss: the model's own `loss(outputs, batch)` when its class defines one (batch: a
  hybridrec.model.task.LossBatch, whose `task_loss(outputs)` is model.task's loss), else
  model.task's loss. Its contract (each rank's value a mean over its own samples) is in
  hybridrec.model.task.
- model.task=retrieval (hybridrec.train.retrieval): the forward gets the step's extra
  negatives (`negatives=`, when train.retrieval.negatives > 0), the loss gathers every rank's
  items, and `interactions` (the dataset's (user, item) pairs) serves the catalogue to the
  negatives and to evaluation (hybridrec.train.topk). The host caches stage, for the item
  feature's tables, exactly the ids the model looks up (`stage_ids`).
- model.task=next_item (hybridrec.train.next_item): the loss at every position of the
  sequences (train.next_item.loss); with the softmax the forward gets the step's uniform
  negatives (`negatives=`), looked up as extra rows of the sequence feature
  (hybridrec.model.sequential.with_negative_rows), which the host caches stage alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybridrec.config import Config
from hybridrec.data.interactions import Interactions
from hybridrec.data.loader import BatchSource
from hybridrec.distributed.env import DistEnv
from hybridrec.model import task_of
from hybridrec.model.retrieval import candidate_ids
from hybridrec.model.sequential import with_negative_rows
from hybridrec.model.tables import EmbeddingTables
from hybridrec.model.task import LossBatch, task_outputs
from hybridrec.train.next_item import NextItemTraining
from hybridrec.train.next_item_eval import NextItemEvaluation
from hybridrec.train.retrieval import RetrievalObjective
from hybridrec.train.topk import CatalogueEval
from hybridrec.types import Batch, KeyedIds, TableConfig, hot_offsets


class Objective:
    """The loss of a step and the forward's extra arguments (module docstring). `model`: the
    model as built (inside DDP or not: its class decides)."""

    def __init__(
        self,
        cfg: Config,
        env: DistEnv,
        model: nn.Module,
        source: BatchSource,
        features: Sequence[TableConfig],
    ) -> None:
        self.cfg = cfg
        model = model.module if isinstance(model, DistributedDataParallel) else model
        self.model = model  # the model's own class: its loss, retrieval features
        self.own_loss = callable(getattr(type(model), "loss", None))
        self.task = task_of(cfg.model.task)
        self.retrieval: RetrievalObjective | None = None
        self.next_item: NextItemTraining | None = None
        self.interactions: Interactions | None = None
        self._evals: dict[tuple[str, int | None], CatalogueEval] = {}
        if cfg.model.task == "next_item":
            from hybridrec.data.sequence_source import SequenceSource

            assert isinstance(source, SequenceSource), "next_item reads data=sequences"
            self.next_item = NextItemTraining(
                cfg.train.next_item.loss, cfg.train.retrieval, env.group, source.windows,
                source.num_items, cfg.train.batch_size, cfg.seed, env.device,
            )  # fmt: skip
            self.sequence_feature = "seq"
            self._next_item_eval = NextItemEvaluation(
                self.model, source, env, cfg.eval.topk, cfg.seed
            )
        if cfg.model.task != "retrieval":
            return
        names = [f.name for f in features]
        offsets = hot_offsets(list(features))
        self.user_feature, self.item_feature = model.user_feature, model.item_feature
        item = names.index(self.item_feature)
        self.interactions = Interactions(
            source,
            offsets[names.index(self.user_feature)],
            offsets[item],
            features[item].num_rows,
        )
        self.user_rows = features[names.index(self.user_feature)].num_rows
        if cfg.train.retrieval.logq and features[item].dynamic is not None:
            t = features[item].table_name
            raise ValueError(
                f"train.retrieval.logq=true corrects each item row's logit by its count in the "
                f"training rows, but item table {t!r} is dynamic: its raw ids get rows only "
                f"while training, and the dataset's counts/{t}.npz counts raw ids, not rows; "
                "set train.retrieval.logq=false (or give the item column a fixed encoding, "
                "vocabulary or identity, to keep logQ)"
            )
        self.retrieval = RetrievalObjective(
            cfg.train.retrieval,
            env.group,
            self.item_feature,
            source.id_counts(item),
            self.interactions.catalogue(),
            cfg.train.batch_size,
            cfg.seed,
            env.device,
        )
        if cfg.train.retrieval.negatives:
            alone = [
                t
                for t in _declarations(model)
                if self.item_feature in t.feature_names and len(t.feature_names) == 1
            ]
            if not alone:
                raise ValueError(
                    f"train.retrieval.negatives={cfg.train.retrieval.negatives}: the model must "
                    f"look up its item feature {self.item_feature!r} in EmbeddingTables of that "
                    "feature alone, once per step (hybridrec.model.retrieval.candidate_ids)"
                )

    def catalogue_eval(self, split: str, env: DistEnv, lookup: int | None) -> CatalogueEval:
        """An evaluation of dataset split `split` over the whole catalogue (retrieval only),
        looking items up `lookup` at a time (None: 8192)."""
        assert self.interactions is not None, "a retrieval model's evaluation"
        key = (split, lookup)
        if key not in self._evals:  # what it reads from the data does not change: read once
            self._evals[key] = CatalogueEval(
                self.model, self.interactions, split, env, self.user_rows, lookup
            )
        return self._evals[key]

    def evaluate_next_item(
        self, split: str, keyed: Any, whole: bool, chunk: int | None
    ) -> dict[str, float]:
        """model.task=next_item: HR@K and NDCG@K of split `split`'s held-out items (the
        whole split, or eval.batches global batches of users), in eval mode."""
        e = self.cfg.eval
        users = None if whole or e.batches is None else e.batches * e.batch_size
        return self._next_item_eval(split, keyed, users, chunk or 8192)

    def forward_kwargs(self, step: int) -> dict[str, Any]:
        """The forward's arguments besides (dense, ids) for training step `step` (from 1)."""
        negatives = None
        if self.retrieval is not None:
            negatives = self.retrieval.negatives(step)
        elif self.next_item is not None:
            negatives = self.next_item.negatives(step)
        return {} if negatives is None else {"negatives": negatives}

    def stage_ids(self, tables: EmbeddingTables, keyed: KeyedIds, step: int) -> torch.Tensor:
        """The ids the model's lookup of `tables` reads at training step `step`: the
        declared features' columns, and for the item feature's own tables with negatives,
        those appended (the one lookup hybridrec.model.retrieval prescribes). The pipeline
        stages a batch before the step that trains it (`step` is hybridrec.train.pipeline
        .staged_step of the step staging it, LOOK_AHEAD later): step `step`'s negatives are
        drawn from `step` alone, so they are the same then as in that step's forward."""
        negatives = self.forward_kwargs(step).get("negatives")
        if negatives is not None and self.next_item is not None:
            if self.sequence_feature in tables.feature_names:
                return with_negative_rows(tables.select(keyed), negatives)
        elif negatives is not None and tables.feature_names == (self.item_feature,):
            return candidate_ids(keyed, self.item_feature, negatives)
        return tables.select(keyed)

    def loss(self, outputs: Any, batch: Batch, keyed: KeyedIds, kwargs: dict) -> torch.Tensor:
        """The loss of `outputs` on this rank's `batch` (a mean over its samples)."""
        if self.retrieval is not None:
            retrieval = self.retrieval

            def task_loss(out: Any) -> torch.Tensor:
                return retrieval(out, keyed, kwargs.get("negatives"))
        elif self.next_item is not None:
            task_loss = self.next_item
        else:

            def task_loss(out: Any) -> torch.Tensor:
                return self.task.loss(task_outputs(out), batch.labels)

        if not self.own_loss:
            return task_loss(outputs)
        return self.model.loss(outputs, LossBatch(batch.dense, keyed, batch.labels, task_loss))


def _declarations(model: nn.Module) -> list[EmbeddingTables]:
    return [m for m in model.modules() if isinstance(m, EmbeddingTables)]
