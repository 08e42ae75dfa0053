"""The exchange over any number of ranks: input dist, output dist, and the backward's order.

`route`: the input dist (hybridrec.sparse.exchange.input) sends each id to the rank that owns
its shard, and numbers every local group's bags (source rank, unit, sample).
`deliver`: replicated tables pool locally (exchange.replicated); the groups' pooled rows go
back to their samples' ranks and each feature is rebuilt (exchange.output); the gradient of
what leaves is scaled by 1/W (docs/architecture.md, the gradient-scaling rule).
`after_backward`: what the output dist's backward runs after its all-to-all, in this order on
every rank: column shards share row statistics (exchange.row_stats), then replicated tables
sync and update. On one rank every exchange is the identity: the same code runs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from hybridrec import timing
from hybridrec.distributed.comm import CommStats
from hybridrec.sparse.bags import jagged_means, mean_divisors
from hybridrec.sparse.exchange.input import input_dist
from hybridrec.sparse.exchange.output import (
    exchange_rows,
    output_dist,
    place_rows,
    reassemble,
    rows_in_place,
)
from hybridrec.sparse.exchange.replicated import replicated_lookup, sync_replicas
from hybridrec.sparse.exchange.routing import build_routes
from hybridrec.sparse.exchange.row_stats import share_row_stats
from hybridrec.sparse.fused import FusedEmbedding
from hybridrec.sparse.layout import GroupKey, ShardedLayout
from hybridrec.sparse.step import StepContext
from hybridrec.types import Embedded


class AllToAll:
    """The Exchange (hybridrec.sparse.step) of any layout, over process group `group`."""

    pools_in_handoff = False  # pooled in fp32: the wire rounds (row-wise partial sums add first)

    def __init__(
        self,
        layout: ShardedLayout,
        stores: Mapping[GroupKey, FusedEmbedding],
        group: dist.ProcessGroup | None,
        stats: CommStats | None,
        device: torch.device,
    ) -> None:
        self.layout, self.stores, self.group, self.stats = layout, stores, group, stats
        self.routes = build_routes(layout, device)
        # the input dist exchanges its payload sizes first: each rank's B_l can ride along
        self.shares_batch = layout.has_counted and layout.world > 1
        self.means = jagged_means(layout.tables)  # divided by bag lengths after the exchange
        self.in_place = rows_in_place(layout)  # the output built by place_rows

    def route(
        self, ids: torch.Tensor, flag: bool | None, share_batch: bool = False
    ) -> tuple[StepContext, bool]:
        lookups, receipt, flagged = input_dist(
            ids, self.layout, self.routes, self.group, self.stats, flag, share_batch
        )
        return StepContext(ids, lookups, receipt), flagged

    def deliver(self, pooled: dict[GroupKey, torch.Tensor], step: StepContext) -> Embedded:
        lay, wire = self.layout, step.wire
        with timing.phase("data_parallel"):
            replicated, replicas = replicated_lookup(step.ids, lay, self.stores)
            if wire.keep:
                replicated = replicated.to(wire.dtype)
        step = step.replace(replicas=replicas)
        assert step.receipt is not None
        # 1/W: in the exchange's backward (wire.keep), or 1 on one rank
        scale = None if wire.keep or lay.world == 1 else 1.0 / lay.world
        if self.in_place:  # the flat received rows straight into each feature's output
            with timing.phase("output_dist"):
                recv, _ = exchange_rows(pooled, replicated, step, lay, self.group, self.stats, self)
            return place_rows(recv, step.receipt.kept, lay, step.ids.shape[0], scale)
        with timing.phase("output_dist"):
            received, replicated = output_dist(
                pooled, replicated, step, lay, self.group, self.stats, self
            )
        divisors = mean_divisors(step.ids, self.means, lay.offsets)
        return reassemble(received, step.receipt.kept, replicated, lay, divisors, scale)

    def after_backward(
        self, step: StepContext, grad_send: torch.Tensor, grad_replicated: torch.Tensor
    ) -> None:
        """The output dist's backward work after its all-to-all (see the module doc)."""
        if step.row_stats is not None:
            share_row_stats(grad_send, step, self.layout, self.group, self.stats, self.stores)
        if self.layout.dp_tables:
            sync_replicas(
                grad_replicated, step.replicas, self.layout, self.stores, self.group, self.stats
            )
