"""Exact mode's all-to-all: the default exchange (hybridrec.sparse.exchange.all_to_all) with
the three steps whose sums depend on the plan or the world size made canonical.

- Row-wise tables: the default returns each shard's pooled partial sum of a bag and adds the
  partials in shard order, another order than one process's sum over the bag's ids in column
  order. Here a row-wise shard returns a row per id, unscaled (routed as a sequence's:
  hybridrec.sparse.exchange.input, `rows_per_id`), and the bag is pooled where its sample is,
  over its ids in column order, by the lookup's own pooling (`PoolByPosition`: the same
  kernel, on a copy of the rows, so the same bits as the owner of a whole table gets).
- No 1/W: exact mode scales the loss, not the embeddings' gradients (hybridrec.exact).
- The backward's work after its all-to-all: column shards' full-row statistics over the whole
  row (hybridrec.sparse.exact.row_stats) and replicated tables' update over the whole global
  batch (hybridrec.sparse.exact.replicas), whose inputs hybridrec.exact gathers with the dense
  gradients (`take_replica_inputs`, `finish_replicas`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from hybridrec import timing
from hybridrec.distributed.comm import CommStats
from hybridrec.kernels.lookup import pool_fp32
from hybridrec.sparse.bags import mean_divisors, pooling_scale
from hybridrec.sparse.exact.replicas import replica_inputs, update_replicas
from hybridrec.sparse.exact.row_stats import share_seen_rows
from hybridrec.sparse.exchange.all_to_all import AllToAll
from hybridrec.sparse.exchange.output import output_dist, reassemble
from hybridrec.sparse.exchange.replicated import replicated_lookup
from hybridrec.sparse.exchange.routing import build_routes
from hybridrec.sparse.fused import FusedEmbedding
from hybridrec.sparse.layout import GroupKey, ShardedLayout
from hybridrec.sparse.step import StepContext


class PoolByPosition(torch.autograd.Function):
    """pooled [num_bags, w] fp32 of rows [n, w] fp32 (bags [n] non-decreasing, per-id scale
    [n] or None), pooled as a group of `dtype` pools its own rows (pool_fp32, on the rows
    cast back to the table's dtype: exact, they came from it). Backward: each row's gradient
    grad[bag] * scale, the product the owner's dedupe would form."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        rows: torch.Tensor,
        bags: torch.Tensor,
        scale: torch.Tensor | None,
        num_bags: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.save_for_backward(bags, scale)
        index = torch.arange(rows.shape[0], device=rows.device)
        return pool_fp32(rows.to(dtype), index, bags, scale, num_bags)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        bags, scale = ctx.saved_tensors
        per_row = grad.float().index_select(0, bags)
        if scale is not None:
            per_row = per_row * scale.unsqueeze(1)
        return per_row, None, None, None, None


class ExactAllToAll(AllToAll):
    """The Exchange of any layout in exact mode (module docstring). `dtype`: the tables'
    storage dtype; `shared`: the groups whose ids the canonical order sorts, with their
    units' features (hybridrec.sparse.exact.update.shared_groups)."""

    def __init__(
        self,
        layout: ShardedLayout,
        stores: Mapping[GroupKey, FusedEmbedding],
        group: dist.ProcessGroup | None,
        stats: CommStats | None,
        device: torch.device,
        dtype: torch.dtype,
        shared: Mapping[GroupKey, torch.Tensor],
    ) -> None:
        super().__init__(layout, stores, group, stats, device)
        self.routes = build_routes(layout, device, rows_per_id=True)
        self.dtype, self.shared = dtype, shared
        self.replicas_pending: list[torch.Tensor] = []  # after_backward's, until taken
        plan = layout.plan.tables
        self.per_id = [  # pooled row-wise features: a row per id comes back
            f
            for f, units in layout.table_units.items()
            if plan[layout.storage_of[f]].sharding.traits.partial_sums
            and not layout.tables[f].sequence
        ]

    def deliver(self, pooled: dict[GroupKey, torch.Tensor], step: StepContext) -> torch.Tensor:
        lay = self.layout
        with timing.phase("data_parallel"):
            replicated, replicas = replicated_lookup(step.ids, lay, self.stores)
        step = step.replace(replicas=replicas)
        with timing.phase("output_dist"):
            received, replicated = output_dist(
                pooled, replicated, step, lay, self.group, self.stats, self
            )
        assert step.receipt is not None
        received, kept = self._pool_per_id(received, step.receipt.kept, step.ids.shape[0])
        divisors = mean_divisors(step.ids, self.means, lay.offsets)
        return reassemble(received, kept, replicated, lay, divisors)

    def _pool_per_id(
        self, received: list[torch.Tensor], kept: dict[int, torch.Tensor], b_local: int
    ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """Each row-wise feature's rows (one per id, from every shard, with their positions
        b * h + j in `kept`) pooled per sample in column order, handed to `reassemble` as its
        first unit's [B_l, w], every sample kept, and its other units as empty."""
        received, kept = list(received), dict(kept)
        for f in self.per_id:
            t, where = self.layout.tables[f], self.layout.table_units[f]
            positions, order = torch.sort(torch.cat([kept[p] for p in where]))
            rows = torch.cat([received[p] for p in where]).index_select(0, order)
            s = pooling_scale(t)
            scale = None if s == 1.0 else torch.full_like(positions, s, dtype=torch.float32)
            bags = positions.div(t.hotness, rounding_mode="floor")
            pooled = PoolByPosition.apply(rows, bags, scale, b_local, self.dtype)
            for n, p in enumerate(where):
                received[p] = pooled if n == 0 else pooled[:0]
                kept[p] = torch.arange(b_local if n == 0 else 0, device=positions.device)
        return received, kept

    def after_backward(
        self, step: StepContext, grad_send: torch.Tensor, grad_replicated: torch.Tensor
    ) -> None:
        """The output dist's backward work after its all-to-all, on every rank: column shards'
        full-row statistics; the replicated tables' inputs kept for `take_replica_inputs`
        (their update waits for the dense gradients' collective, which carries them)."""
        if step.row_stats is not None:
            share_seen_rows(
                grad_send, step, self.layout, self.group, self.stats, self.stores, self.shared
            )
        if self.layout.dp_tables:
            self.replicas_pending = replica_inputs(grad_replicated, step.ids, self.layout)

    def take_replica_inputs(self) -> list[torch.Tensor]:
        """The replicated tables' inputs of this step's backward (`replica_inputs`: [] when
        none), handed over once: the caller gathers them from every rank (hybridrec.exact: in
        the dense gradients' collective) and calls `finish_replicas` with them, every step."""
        pending, self.replicas_pending = self.replicas_pending, []
        return pending

    def finish_replicas(self, gathered: list[torch.Tensor]) -> None:
        """The replicated tables' canonical update from `take_replica_inputs` of every rank,
        gathered in rank order."""
        if gathered:
            update_replicas(gathered, self.layout, self.stores)
