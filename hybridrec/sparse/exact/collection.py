"""The sharded collection in exact mode: the same plan, groups, exchanges, host caches and
dynamic maps as the default (hybridrec.sparse.sharded), with every sum over samples in one
canonical order (hybridrec.sparse.exact: the all-to-all's row-wise pooling, the backward's
row sums and statistics, the replicas' update), so that any world size updates every row to
the bits one process does.

It is trained through hybridrec.exact (one lookup of the rank's whole batch per step, the
dense part per micro-shard, the loss scaled there): a training forward outside it would get
none of that, so it raises. Evaluation (no gradient) takes any batch, as the default's.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridrec.sparse.exact.exchange import ExactAllToAll
from hybridrec.sparse.exact.update import (
    ExactLookup,
    canonical_order,
    sample_major_features,
    shared_groups,
)
from hybridrec.sparse.exchange.sample_major import SampleMajor
from hybridrec.sparse.layout import GroupKey
from hybridrec.sparse.sharded import ShardedEmbeddingCollection
from hybridrec.sparse.step import GroupInput, StepContext


class ExactCollection(ShardedEmbeddingCollection):
    """ShardedEmbeddingCollection in exact mode (module docstring). `micro_shards`: the
    global batch's micro-shards (hybridrec.exact), `seed` kept for their random streams; the
    other arguments as ShardedEmbeddingCollection's."""

    def __init__(self, *args: Any, micro_shards: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.comm_dtype != torch.float32:
            raise ValueError(
                f"exact mode carries pooled embeddings in fp32: comm_dtype={self.comm_dtype} "
                "rounds them (sharding.comm_dtype=fp32)"
            )
        if self.device.type != "cpu":
            raise ValueError(
                f"exact mode runs on the CPU (its canonical sums use the CPU kernels); the "
                f"device is {self.device}: use device=cpu, or train without train.exact"
            )
        self.micro_shards = micro_shards
        self.seed = int(kwargs.get("seed", 0))
        self.shared = shared_groups(self.layout)
        self.slot_features = sample_major_features(self.tables)
        stores = {key: g.store for key, g in self.groups.items()}
        dtype = next(iter(stores.values())).weight.dtype if stores else torch.float32
        self.all_to_all = ExactAllToAll(
            self.layout, stores, self.group, self.stats, self.device, dtype, self.shared
        )
        if not isinstance(self.exchange, SampleMajor):
            self.exchange = self.all_to_all
        self.in_step = False  # set by hybridrec.exact around the step's lookup

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.training and not self.in_step:
            raise RuntimeError(
                "this model was parallelized in exact mode (exact_shards): train it with "
                "hybridrec.exact_step(model, loss_fn, dense, ids, labels) (docs/exact.md), "
                "not by its own forward and loss.backward()"
            )
        return super().forward(ids)

    def _lookup(self, key: GroupKey, inp: GroupInput, step: StepContext) -> torch.Tensor:
        """Group `key`'s pooled rows, its backward the canonical update (ExactLookup)."""
        store = self.groups[key].store
        if not torch.is_grad_enabled() or store.optimizer is None:
            return super()._lookup(key, inp, step)
        row_sq = None
        if step.row_stats is not None and any(
            k in self.layout.peers for k in self.layout.group_units[key]
        ):
            row_sq = lambda: step.row_stats.take(key)  # noqa: E731
        order = None
        if key in self.shared:
            order = canonical_order(inp, self.shared[key], self.slot_features)
        anchor = torch.zeros(0, device=self.device, requires_grad=True)
        return ExactLookup.apply(
            anchor, store, inp.rows, inp.bags, inp.scale, inp.num_bags, row_sq,
            step.prefetched.get(key), order,
        )  # fmt: skip
