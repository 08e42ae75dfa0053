"""The sharded embedding collection: same interface as EmbeddingCollection, tables spread
over ranks by a ShardingPlan.

    forward(ids [B_l, H]) -> pooled [B_l, T, D]    (B_l = this rank's slice of the global B)

Every table shard that is not data-parallel is a *unit* served by its owner rank. One step:

1. input dist (one all_to_all_single of int32, or int64 if a table has more than 2**31 - 1
   rows): each rank sends, to the owner of each unit, its samples' ids for that unit's
   table: all of them for table-wise and column-wise units; for row-wise units only the ids
   inside the unit's row range (shifted to the shard), plus per-sample counts, after a small
   all-to-all of the payload sizes. Receiving ranks concatenate in source-rank order, which
   is global-sample order.
2. lookup: the owner pools its units over the global batch, one fused lookup per width
   (hybridrec.sparse.fused), giving [B, w_u] per unit.
3. output dist (one differentiable all_to_all_single of fp32, or of bf16 where that is
   exact: `handoff_dtype`): each unit's rows for rank p's samples go back to rank p, which
   rebuilds each table: the table-wise unit as is, column-wise slices concatenated in
   column order, row-wise partial sums added.
4. data-parallel tables are replicated: each rank pools its own samples, with no exchange
   in forward; in backward every rank deduplicates its rows' gradients and one all-reduce
   sums them (with a per-row "touched" count) so every replica applies the reference's
   update to the rows any rank used.

Row-wise Adagrad keeps one statistic per row, mean(g^2) over the full width; a column shard
sees only its columns. So, when that optimizer meets column-wise tables, the backward adds one
small all-to-all: the owners of a table's column shards hold the same unique
rows in the same order, so each sends the others its per-row partial sums of g^2 and every
owner applies the full-row statistic, exactly as the unsharded table would.

Backward runs every collective of the embedding side inside one autograd node (_Exchange),
in a fixed order on every rank: the output-dist all-to-all in reverse, then the row-statistic
exchange, then the replicated tables' all-reduce. Collectives must be issued in the same
order on all ranks; one node makes that order explicit rather than a property of autograd's
scheduling. Each owner's fused group then updates its rows with the gradients of the whole
global batch. The output is scaled by 1/W in backward (gradient-scaling convention:
hybridrec.parallelize).

One rank (sharding=host on one GPU, any mode at W=1) has nothing to exchange: collectives on
a one-rank group return their input, and when one group holds every table whole and in
order, the forward is the local collection's sample-major lookup (`one_rank`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hybridrec.distributed.comm import (
    CommStats,
    ScaleGrad,
    all_gather_rows,
    all_reduce_sum,
    all_to_all,
    any_rank,
)
from hybridrec.kernels.segment import dedupe
from hybridrec.planner.planner import id_wire_bytes, replica_sync
from hybridrec.sparse.collection import (
    IdChecker,
    IdOutOfRangeError,
    SampleMajorLayout,
    lookup_sample_major,
    pooling_scale,
    sample_major_layout,
    sample_major_rows,
)
from hybridrec.sparse.fused import FusedEmbedding, LookupInput, RowOptimizer, regular_bags
from hybridrec.sparse.host import CacheStats, HostCachedEmbedding
from hybridrec.timing import NULL_TIMER, PhaseTimer
from hybridrec.types import (
    CACHE_HALFLIFE,
    ShardingPlan,
    ShardingType,
    ShardSpec,
    TableConfig,
    hot_offsets,
)


@dataclass(frozen=True)
class _Unit:
    """One non-replicated shard and the table it belongs to."""

    table_index: int
    table: TableConfig
    shard: ShardSpec
    row_wise: bool


class ShardedEmbeddingCollection(nn.Module):
    """This rank's part of every table, plus the exchanges that make it look local."""

    def __init__(
        self,
        tables: Sequence[TableConfig],
        plan: ShardingPlan,
        group: dist.ProcessGroup,
        optimizer: RowOptimizer | None,
        seed: int = 0,
        device: torch.device | str = "cpu",
        check_ids: bool = True,
        stats: CommStats | None = None,
        dtype: torch.dtype = torch.float32,
        pin_host: bool = True,
        host_copy: str = "auto",
        comm_dtype: torch.dtype = torch.float32,
        cache_halflife: int = CACHE_HALFLIFE,
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        self.group, self.stats = group, stats
        # pooled embeddings and their gradients travel in this dtype (fp32: exact; bf16 or
        # fp16 halve the output dist's bytes, rounding what crosses; sums stay fp32)
        self.comm_dtype = comm_dtype
        self.timer: PhaseTimer = NULL_TIMER  # the trainer sets its own
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device(device)
        _check_plan(self.tables, plan, self.world)
        if len({t.dim for t in self.tables}) != 1:
            raise ValueError("all tables of a collection must share one embedding dim")
        self.offsets = hot_offsets(self.tables)
        self.checker = IdChecker(self.tables) if check_ids else None
        # ids cross the input dist as int32 where they fit (half the bytes, exact); checked
        # ids are in range (on CUDA bad ones were read as 0 before), so none can wrap
        self.id_dtype = torch.int32 if id_wire_bytes(self.tables) == 4 else torch.int64

        self.units_on: list[list[_Unit]] = [[] for _ in range(self.world)]
        self.table_units: dict[int, list[int]] = {}  # table -> positions in the received list
        self.dp_tables: list[int] = []
        self.replicated_tables: set[str] = set()  # saved once, by rank 0
        for i, tp in enumerate(plan.tables):
            if tp.sharding == ShardingType.DATA_PARALLEL:
                self.dp_tables.append(i)
                self.replicated_tables.add(tp.table)
                continue
            for s in tp.shards:
                rw = tp.sharding == ShardingType.ROW_WISE
                self.units_on[s.rank].append(_Unit(i, self.tables[i], s, rw))
        # Received units arrive in (source rank, table) order; list each table's in shard
        # order (for column-wise: column order; for row-wise: the order partial sums are added).
        position = {}
        for u in (u for units in self.units_on for u in units):
            position[(u.table_index, u.shard)] = len(position)
        for i, tp in enumerate(plan.tables):
            if tp.sharding != ShardingType.DATA_PARALLEL:
                self.table_units[i] = [position[(i, s)] for s in tp.shards]
        self.table_kind = {i: plan.tables[i].sharding for i in range(len(self.tables))}
        self.plan = plan
        self.has_row_wise = any(u.row_wise for units in self.units_on for u in units)
        # Every exchanged value is a whole pooled value (no row-wise partial sums to add):
        # then the bf16 hand-off (see `handoff_dtype`) can cross ranks in bf16, exactly.
        self.whole_values = whole_values(plan)
        self.autocast_output = False  # set for DLRM by hybridrec.parallelize
        self.width_on = [sum(u.shard.width for u in units) for units in self.units_on]

        # This rank's units, one fused group per width and placement ("w<width>" in device
        # memory, "h<width>" in host memory behind a device cache: hybridrec.sparse.host);
        # slot[k] = (group key, index in group).
        self.local_units = self.units_on[self.rank]
        by_key: dict[str, list[int]] = {}
        for k, u in enumerate(self.local_units):
            by_key.setdefault(f"{'h' if u.shard.on_host else 'w'}{u.shard.width}", []).append(k)
        self.slots: list[tuple[str, int]] = [("", 0)] * len(self.local_units)
        groups: dict[str, FusedEmbedding] = {}
        for key, ks in by_key.items():
            units = [self.local_units[k] for k in ks]
            shards = [(u.table, u.table_index, u.shard) for u in units]
            if key.startswith("h"):
                cache_rows = sum(u.shard.cache_rows for u in units)
                groups[key] = HostCachedEmbedding(
                    shards,
                    optimizer,
                    cache_rows,
                    seed,
                    device,
                    dtype,
                    pin_host,
                    age_every=cache_halflife,
                    copy=host_copy,
                )
            else:
                groups[key] = FusedEmbedding(shards, optimizer, seed, device, dtype)
            for pos, k in enumerate(ks):
                self.slots[k] = (key, pos)
        self.group_units = by_key  # group key -> its local units, in group order
        # Host-resident shards anywhere: every rank then joins prefetch()'s collectives.
        self.has_host = any(s.on_host for tp in plan.tables for s in tp.shards)
        # from prefetch(): (ids given, checked ids, their input dist | None, one-rank group
        # rows | None)
        self._prefetched: (
            tuple[torch.Tensor, torch.Tensor, list[LookupInput] | None, torch.Tensor | None] | None
        ) = None
        # Replicated tables: the full table on every rank, grouped by width the same way.
        dp_by_width: dict[int, list[int]] = {}
        for i in self.dp_tables:
            dp_by_width.setdefault(self.tables[i].dim, []).append(i)
        self.dp_group_tables = {f"dp_w{w}": idx for w, idx in dp_by_width.items()}
        for key, idx in self.dp_group_tables.items():
            shards = [(self.tables[i], i, plan.tables[i].shards[self.rank]) for i in idx]
            groups[key] = FusedEmbedding(shards, optimizer, seed, device, dtype)
        self.groups = nn.ModuleDict(groups)
        # Column shards that must share row-wise optimizer statistics: peers[k] = the ranks
        # holding the other column shards of local unit k's table.
        self.peers: dict[int, list[int]] = {}
        if getattr(optimizer, "needs_full_row_stat", False):
            for k, u in enumerate(self.local_units):
                if self.table_kind[u.table_index] == ShardingType.COLUMN_WISE:
                    ranks = [s.rank for s in plan.tables[u.table_index].shards]
                    self.peers[k] = [r for r in ranks if r != self.rank]
        self.exchange_row_stats = getattr(optimizer, "needs_full_row_stat", False) and any(
            tp.sharding == ShardingType.COLUMN_WISE for tp in plan.tables
        )
        self._inputs: list[LookupInput] = []
        self._dp_inputs: dict[str, list[LookupInput]] = {}
        self.one_rank = self._one_rank_layout()

    def _one_rank_layout(self) -> SampleMajorLayout | None:
        """One rank whose one group holds every table whole, in table order (sharding=host on
        one GPU, or any mode at W=1 without replicated tables): the lookup then runs
        sample-major like the local collection's, with no exchange, split, stack or cat
        (hybridrec.sparse.collection.sample_major_layout). None otherwise."""
        if self.world != 1 or self.dp_tables or len(self.group_units) != 1:
            return None
        [(key, ks)] = self.group_units.items()
        units = [self.local_units[k] for k in ks]
        whole = all(
            u.shard.row_start == 0
            and u.shard.row_end == u.table.num_rows
            and u.shard.col_start == 0
            and u.shard.width == u.table.dim
            for u in units
        )
        if not whole or [u.table_index for u in units] != list(range(len(self.tables))):
            return None
        return sample_major_layout(self.tables, self.groups[key])

    def plan_shards(self, table_index: int) -> tuple[ShardSpec, ...]:
        return self.plan.tables[table_index].shards

    # -- steps of forward -------------------------------------------------------------------
    def _check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids, checked: every rank learns whether any rank saw a bad id, so all fail together
        (no hang). Deferred on CUDA (IdChecker): bad ids read as 0 until raise_bad_ids."""
        if self.checker is None:
            return ids
        if self.checker.deferred(ids):
            return self.checker.sanitize(ids, sample_base=self.rank * ids.shape[0])
        bad = self.checker.bad_mask(ids)
        local_bad = bool(bad.any())
        if any_rank(local_bad, self.group, ids.device):
            if local_bad:
                self.checker.raise_first(ids, bad, sample_base=self.rank * ids.shape[0])
            raise IdOutOfRangeError(
                f"rank {self.rank}: another rank found an out-of-range id in this batch "
                "(that rank's error names the feature and the id)"
            )
        return ids

    def raise_bad_ids(self) -> None:
        """Raise, on every rank, for a bad id a deferred check met on any rank (collective)."""
        if self.checker is None:
            return
        local = self.checker.found()
        if any_rank(local, self.group, self.device):
            if local:
                self.checker.raise_recorded()
            raise IdOutOfRangeError(
                f"rank {self.rank}: another rank found an out-of-range id in a batch since the "
                "last check (that rank's error names the feature and the id)"
            )

    def _input_dist(self, ids: torch.Tensor) -> list[LookupInput]:
        """ids [B_l, H] -> one LookupInput over the global batch per local unit."""
        b_local, world = ids.shape[0], self.world
        chunks = []
        for q in range(world):
            static, dynamic = [], []
            for u in self.units_on[q]:
                cols = ids[:, self.offsets[u.table_index] : self.offsets[u.table_index + 1]]
                if u.row_wise:
                    inside = (cols >= u.shard.row_start) & (cols < u.shard.row_end)
                    static.append(inside.sum(1))
                    dynamic.append(cols[inside] - u.shard.row_start)
                else:
                    static.append(cols.reshape(-1))
            chunks.append(torch.cat(static + dynamic) if static else ids.new_empty(0))
        in_splits = [c.numel() for c in chunks]
        static_sizes = [
            b_local if u.row_wise else b_local * u.table.hotness for u in self.local_units
        ]
        if self.has_row_wise:
            counts = torch.tensor(in_splits, dtype=torch.int64, device=ids.device)
            ones = [1] * world
            out_splits = all_to_all(
                counts, ones, ones, self.group, self.stats, "input_dist.counts"
            ).tolist()
        else:
            out_splits = [sum(static_sizes)] * world
        recv = all_to_all(
            torch.cat(chunks).to(self.id_dtype),
            out_splits,
            in_splits,
            self.group,
            self.stats,
            "input_dist",
        )
        return self._parse_ids(recv.long(), out_splits, static_sizes, b_local)

    def _parse_ids(
        self, recv: torch.Tensor, out_splits: list[int], static_sizes: list[int], b_local: int
    ) -> list[LookupInput]:
        n_static = sum(static_sizes)
        per_unit: list[list[torch.Tensor]] = [[] for _ in self.local_units]
        lengths: list[list[torch.Tensor]] = [[] for _ in self.local_units]
        rw = [k for k, u in enumerate(self.local_units) if u.row_wise]
        for chunk in torch.split(recv, out_splits):
            parts = torch.split(chunk[:n_static], static_sizes)
            for k, part in enumerate(parts):
                (lengths if k in rw else per_unit)[k].append(part)
            if rw:
                sizes = torch.stack([parts[k].sum() for k in rw]).tolist()
                for k, part in zip(rw, torch.split(chunk[n_static:], sizes), strict=True):
                    per_unit[k].append(part)
        batch = b_local * self.world
        inputs = []
        for k, u in enumerate(self.local_units):
            unit_ids = torch.cat(per_unit[k])
            if u.row_wise:
                bags = torch.repeat_interleave(
                    torch.arange(batch, device=recv.device), torch.cat(lengths[k])
                )
            else:
                bags = regular_bags(batch, u.table.hotness, recv.device)
            inputs.append(LookupInput(unit_ids, bags, batch, pooling_scale(u.table)))
        return inputs

    def handoff_dtype(self, device: torch.device) -> torch.dtype | None:
        """The autocast dtype when the pooled embeddings go to the dense part in it: under
        autocast, with `autocast_output` (DLRM: the dot interaction casts them first) and
        whole values on the wire (no row-wise partial sums still to add). The output dist
        then carries that dtype both ways: half the bytes of fp32, exactly. Forward, the
        values are rounded where the interaction would round them anyway; backward, the
        gradients are the interaction's, already in that dtype, and the 1/W scale is applied
        in fp32 after the exchange instead of before it: the same products. None: fp32."""
        if self.autocast_output and self.whole_values and torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return None

    def _lookup(self, inputs: list[LookupInput]) -> list[torch.Tensor]:
        """One fused lookup per width group; returns [B, w_u] per local unit."""
        out: list[torch.Tensor | None] = [None] * len(inputs)
        for key, group in self.groups.items():
            ks = self.group_units.get(key)
            if not ks:  # replicated tables: looked up separately
                continue
            for k, pooled in zip(ks, group([inputs[k] for k in ks]), strict=True):
                out[k] = pooled
        return out  # type: ignore[return-value]

    def _output_dist(
        self,
        pooled: list[torch.Tensor],
        replicated: torch.Tensor,
        b_local: int,
        handoff: torch.dtype | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Local units' [B, w_u] -> every unit's [B_l, w_u] for this rank's samples.

        `replicated` [B_l, T_dp, D] (no grad) passes through the same autograd node, whose
        backward also syncs the replicated tables (see _Exchange)."""
        world = self.world
        if pooled:
            send = torch.cat([p.reshape(world, -1) for p in pooled], dim=1).reshape(-1)
        else:
            send = torch.zeros(0, device=self.device)
        if torch.is_grad_enabled() and not send.requires_grad:
            send = send.detach().requires_grad_()  # this rank must still join the backward
        in_splits = [b_local * self.width_on[self.rank]] * world
        out_splits = [b_local * w for w in self.width_on]
        recv, replicated = _Exchange.apply(
            send, replicated, self, b_local, out_splits, in_splits, handoff
        )
        units = []
        for q, chunk in enumerate(torch.split(recv, out_splits)):
            sizes = [b_local * u.shard.width for u in self.units_on[q]]
            for u, part in zip(self.units_on[q], torch.split(chunk, sizes), strict=True):
                units.append(part.view(b_local, u.shard.width))
        return units, replicated

    @torch.no_grad()
    def _replicated_lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Replicated tables, looked up for this rank's own samples: [B_l, T_dp, D].

        No autograd here: _Exchange's backward updates them after the all-reduce."""
        b_local = ids.shape[0]
        pooled: dict[int, torch.Tensor] = {}
        self._dp_inputs = {}
        for key, idx in self.dp_group_tables.items():
            inputs = []
            for i in idx:
                t = self.tables[i]
                cols = ids[:, self.offsets[i] : self.offsets[i + 1]]
                bags = regular_bags(b_local, t.hotness, ids.device)
                inputs.append(LookupInput(cols.reshape(-1), bags, b_local, pooling_scale(t)))
            self._dp_inputs[key] = inputs
            pooled.update(zip(idx, self.groups[key](inputs), strict=True))
        if not self.dp_tables:
            return torch.zeros(b_local, 0, self.tables[0].dim, device=ids.device)
        return torch.stack([pooled[i] for i in self.dp_tables], dim=1)

    @torch.no_grad()
    def _sync_replicas(self, grad: torch.Tensor) -> None:
        """grad [B_l, T_dp, D] of this rank's samples -> the same update on every replica.

        Each rank deduplicates its rows' gradients; then, the cheaper way for the group's
        size (hybridrec.planner.cost.replica_sync, the same choice on every rank), either a
        dense [rows, D + 1] all-reduce (gradient sums and a "touched" count) or an all-gather
        of every rank's touched rows, summed in rank order. Either way every replica applies
        the reference's update to exactly the rows some rank used."""
        position = {i: n for n, i in enumerate(self.dp_tables)}
        b_local = grad.shape[0]
        for key, idx in self.dp_group_tables.items():
            group = self.groups[key]
            with group.timer.phase("sparse_update"):
                rows, bags, scale, _ = group.flatten(self._dp_inputs[key])
                grad_pooled = torch.cat([grad[:, position[i]] for i in idx])
                unique_rows, grads = dedupe(rows, bags, scale, grad_pooled)
            ids = b_local * sum(self.tables[i].hotness for i in idx)
            if self.world == 1:  # the only replica: its own rows and sums
                rows_all, grads_all = unique_rows, grads
            elif replica_sync(group.num_rows, group.width, ids, self.world)[0] == "all_reduce":
                total = torch.zeros(group.num_rows, group.width + 1, device=grads.device)
                total[unique_rows, : group.width] = grads
                total[unique_rows, group.width] = 1.0
                all_reduce_sum(total, self.group, self.stats, "dp_grads")
                touched = (total[:, group.width] > 0).nonzero().squeeze(1)
                rows_all, grads_all = touched, total[touched, : group.width]
            else:
                rows_all, grads_all = self._gather_touched(unique_rows, grads)
            with group.timer.phase("sparse_update"):
                group.update_rows(rows_all, grads_all)

    def _gather_touched(
        self, rows: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's (rows [U_r], grads [U_r, D]) -> their union, summed in rank order."""
        counts = all_gather_rows(rows.new_tensor([rows.numel()]), self.group, None)
        most = int(counts.max())
        rows_pad = torch.full((most,), -1, dtype=rows.dtype, device=rows.device)
        rows_pad[: rows.numel()] = rows
        grads_pad = grads.new_zeros(most, grads.shape[1])
        grads_pad[: rows.numel()] = grads
        all_rows = all_gather_rows(rows_pad, self.group, self.stats, "dp_grads")
        all_grads = all_gather_rows(grads_pad, self.group, self.stats, "dp_grads")
        valid = all_rows >= 0
        union, inverse = torch.unique(all_rows[valid], sorted=True, return_inverse=True)
        summed = grads.new_zeros(union.numel(), grads.shape[1])
        return union, summed.index_add_(0, inverse, all_grads[valid])

    def _share_row_stats(self, grad: torch.Tensor, b_local: int) -> None:
        """Column shards of one table share per-row sums of g^2 (row-wise Adagrad).

        grad [W * B_l * width_on[rank]]: the gradients of this rank's units, as sent."""
        world = self.world
        per_rank = grad.view(world, -1)  # row p: rank p's samples, units side by side
        partial: dict[int, torch.Tensor] = {}
        col = 0
        for k, u in enumerate(self.local_units):
            width = u.shard.width * b_local
            if k in self.peers:
                g_unit = per_rank[:, col : col + width].reshape(world * b_local, u.shard.width)
                inp = self._inputs[k]
                _, g_rows = dedupe(inp.ids, inp.bags, inp.scale, g_unit)
                partial[k] = g_rows.pow(2).sum(dim=1)
            col += width
        sends = [[partial[k] for k in partial if q in self.peers[k]] for q in range(world)]
        in_splits = [sum(p.numel() for p in parts) for parts in sends]
        out_splits = [
            sum(partial[k].numel() for k in partial if q in self.peers[k]) for q in range(world)
        ]
        flat = [p for parts in sends for p in parts]
        flat_t = torch.cat(flat) if flat else grad.new_zeros(0)
        recv = all_to_all(flat_t, out_splits, in_splits, self.group, self.stats, "row_stats")
        received: dict[tuple[int, int], torch.Tensor] = {}
        for q, chunk in enumerate(torch.split(recv, out_splits)):
            ks = [k for k in partial if q in self.peers[k]]
            sizes = [partial[k].numel() for k in ks]
            for k, part in zip(ks, torch.split(chunk, sizes), strict=True):
                received[(k, q)] = part
        for k, u in enumerate(self.local_units):
            if k not in partial:
                continue
            total = None
            for s in self.plan_shards(u.table_index):  # shard order: the same sum everywhere
                part = partial[k] if s.rank == self.rank else received[(k, s.rank)]
                total = part if total is None else total + part
            key, pos = self.slots[k]
            self.groups[key].row_sq_override[pos] = total / u.table.dim

    def shard_views(self) -> list[tuple[ShardSpec, torch.Tensor, dict[str, torch.Tensor]]]:
        """Every shard held here: (spec, weight view [rows, width], optimizer-state views)."""
        return [view for group in self.groups.values() for view in group.shard_views()]

    def host_groups(self) -> list[HostCachedEmbedding]:
        return [g for g in self.groups.values() if isinstance(g, HostCachedEmbedding)]

    def warm_start_caches(self, counts: Callable[[int], np.ndarray | None], batch_size: int) -> int:
        """Fill each host cache with its most frequent rows: `counts(t)` gives table t's id
        frequencies [num_rows] (None: unknown). Returns the rows loaded on this rank."""
        loaded = 0
        for key, group in self.groups.items():
            if not isinstance(group, HostCachedEmbedding):
                continue
            freq = torch.zeros(group.num_rows, dtype=torch.float64)
            known = False
            ks = self.group_units[key]
            ids_per_step = 0.0
            for pos, k in enumerate(ks):
                u = self.local_units[k]
                table_counts = counts(u.table_index)
                if table_counts is None:
                    continue
                known = True
                a = group.offsets_list[pos]
                part = torch.from_numpy(table_counts[u.shard.row_start : u.shard.row_end])
                freq[a : a + u.shard.num_rows] = part.double()
                share = part.sum().item() / max(1, int(table_counts.sum()))
                ids_per_step += batch_size * u.table.hotness * share
            if known:
                loaded += group.warm_start(freq, ids_per_step)
        return loaded

    def warm_hit_rate(self) -> float | None:
        """The hit rate this rank's warm-started caches give if ids follow the counts they
        started from (HostCachedEmbedding.warm_start); None before a warm start."""
        cached, total = 0.0, 0.0
        for g in self.host_groups():
            cached, total = cached + g.warm_hits[0], total + g.warm_hits[1]
        return cached / total if total else None

    def cache_stats(self) -> CacheStats | None:
        """This rank's host-cache counters since the last call (None: no host groups here)."""
        groups = self.host_groups()
        if not groups:
            return None
        total = CacheStats()
        for g in groups:
            total.add(g.take_stats())
        return total

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start moving the next batch's host-resident rows into the device caches.

        ids [B_l, H]: this rank's next batch. Collective when any rank holds host-resident
        shards (the ids travel by the same input dist the forward uses, whose result the next
        forward reuses), so every rank calls it at the same point: the trainer does, between
        a step's forward and its backward."""
        if not self.has_host:
            return
        # one phase for all of it (outside the forward, so not counted in its phases)
        with self.timer.phase("host_prefetch"):
            clean = self._check_ids(ids.to(self.device, non_blocking=True))
            if self.one_rank is not None:
                # the forward passes the cache these very rows: it knows them prefetched
                rows = sample_major_rows(clean, self.one_rank)
                self._prefetched = (ids, clean, None, rows)
                [group] = self.groups.values()
                assert isinstance(group, HostCachedEmbedding)
                group.prefetch(rows)
                return
            inputs = self._input_dist(clean)
            self._prefetched = (ids, clean, inputs, None)
            for key, group in self.groups.items():
                if isinstance(group, HostCachedEmbedding):
                    ks = self.group_units[key]
                    group.prefetch(group.flatten([inputs[k] for k in ks])[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B_l, H] int64 -> pooled [B_l, T, D] fp32 (this rank's samples)."""
        b_local = ids.shape[0]
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] is ids:
            _, ids, inputs, rows = prefetched  # checked (and distributed) by prefetch()
        else:  # ids may come from the host (a no-op when they are on the device already)
            ids, inputs, rows = self._check_ids(ids.to(self.device, non_blocking=True)), None, None
        if self.one_rank is not None:
            return self._one_rank_forward(ids, rows)
        if inputs is None:
            with self.timer.phase("input_dist"):
                inputs = self._input_dist(ids)
        self._inputs = inputs if self.exchange_row_stats else []
        handoff = self.handoff_dtype(ids.device)
        with self.timer.phase("lookup"):
            pooled = self._lookup(inputs)
        with self.timer.phase("data_parallel"):
            replicated = self._replicated_lookup(ids)
            if handoff is not None:
                replicated = replicated.to(handoff)
        with self.timer.phase("output_dist"):
            received, replicated = self._output_dist(pooled, replicated, b_local, handoff)
        dp_position = {i: n for n, i in enumerate(self.dp_tables)}
        per_table = []
        for i in range(len(self.tables)):
            if i in dp_position:
                per_table.append(replicated[:, dp_position[i]])
                continue
            pieces = [received[p] for p in self.table_units[i]]
            if self.table_kind[i] == ShardingType.COLUMN_WISE:
                per_table.append(torch.cat(pieces, dim=1))
            else:  # table-wise: one piece; row-wise: partial sums, added in shard order
                total = pieces[0]
                for p in pieces[1:]:
                    total = total + p
                per_table.append(total)
        if handoff is not None or self.world == 1:  # 1/W: in _Exchange's backward, or 1
            return torch.stack(per_table, dim=1)
        return ScaleGrad.apply(torch.stack(per_table, dim=1), 1.0 / self.world)

    def _one_rank_forward(self, ids: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The one-rank layout's forward on checked ids: sample-major, as the local
        collection's (1/W = 1); `rows`: their group rows when prefetch() made them."""
        assert self.one_rank is not None
        [group] = self.groups.values()
        with self.timer.phase("lookup"):
            out_dtype = self.handoff_dtype(ids.device) or torch.float32
            return lookup_sample_major(ids, self.one_rank, group, out_dtype, rows)


class _Exchange(torch.autograd.Function):
    """Forward: the output-dist all-to-all of fp32 `send` (in the collection's comm_dtype,
    back to fp32 on arrival; with a `handoff` dtype, in it and kept in it); `replicated`
    passes through.

    Backward, in this order on every rank: (1) the all-to-all in reverse, returning each
    unit's gradients to its owner (with a handoff dtype: in it, then scaled by 1/W in fp32);
    (2) column shards share row statistics (row-wise Adagrad only); (3) replicated tables
    all-reduce their row gradients and update."""

    @staticmethod
    def forward(ctx, send, replicated, coll, b_local, out_splits, in_splits, handoff):  # type: ignore[override]  # noqa: ANN001, E501
        ctx.coll, ctx.b_local, ctx.splits = coll, b_local, (out_splits, in_splits)
        ctx.wire = handoff or coll.comm_dtype
        ctx.scale = 1.0 / coll.world if handoff is not None else 1.0
        recv = all_to_all(
            send.to(ctx.wire), out_splits, in_splits, coll.group, coll.stats, "output_dist"
        )
        return (recv if handoff is not None else recv.float()), replicated.view_as(replicated)

    @staticmethod
    def backward(ctx, grad_recv, grad_replicated):  # type: ignore[override]  # noqa: ANN001
        coll: ShardedEmbeddingCollection = ctx.coll
        out_splits, in_splits = ctx.splits
        grad_send = all_to_all(
            grad_recv.to(ctx.wire).contiguous(),
            in_splits,
            out_splits,
            coll.group,
            coll.stats,
            "output_dist.backward",
        ).float()
        grad_replicated = grad_replicated.float()
        if ctx.scale != 1.0:  # the handoff's 1/W: the product ScaleGrad forms in fp32
            grad_send = grad_send * ctx.scale
            grad_replicated = grad_replicated * ctx.scale
        if coll.exchange_row_stats:
            coll._share_row_stats(grad_send, ctx.b_local)
        if coll.dp_tables:
            coll._sync_replicas(grad_replicated)
        return grad_send, None, None, None, None, None, None


def whole_values(plan: ShardingPlan) -> bool:
    """Whether every value the output dist carries is a whole pooled value: no table is
    split by rows (whose partial sums must be added in fp32 before any rounding)."""
    return all(len(tp.shards) == 1 or tp.sharding != ShardingType.ROW_WISE for tp in plan.tables)


def _check_plan(tables: list[TableConfig], plan: ShardingPlan, world: int) -> None:
    """The plan must cover exactly these tables, in order, for this world size."""
    if plan.world_size != world:
        raise ValueError(f"plan is for {plan.world_size} ranks but the group has {world}")
    names = [tp.table for tp in plan.tables]
    if names != [t.name for t in tables]:
        raise ValueError(f"plan tables {names} do not match the model's {[t.name for t in tables]}")
    for t, tp in zip(tables, plan.tables, strict=True):
        if tp.sharding == ShardingType.DATA_PARALLEL:
            if sorted(s.rank for s in tp.shards) != list(range(world)):
                raise ValueError(f"data-parallel table {t.name} needs one shard on every rank")
            continue
        cells = sum(s.num_rows * s.width for s in tp.shards)
        if cells != t.num_rows * t.dim:
            raise ValueError(
                f"shards of table {t.name} cover {cells} cells, not {t.num_rows}x{t.dim}"
            )
        if tp.sharding == ShardingType.COLUMN_WISE:
            starts = [s.col_start for s in tp.shards]
            if starts != sorted(starts):
                raise ValueError(f"column shards of table {t.name} must be in column order")
