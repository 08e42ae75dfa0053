"""The sharded embedding collection: same interface as EmbeddingCollection, tables spread
over ranks by a ShardingPlan.

    forward(ids [B_l, H]) -> pooled [B_l, T, D]    (B_l = this rank's slice of the global B)

Every table shard that is not data-parallel is a *unit* served by its owner rank. One step:

1. input dist (one all_to_all_single of int64): each rank sends, to the owner of each unit,
   its samples' ids for that unit's table: all of them for table-wise and column-wise units;
   for row-wise units only the ids inside the unit's row range (shifted to the shard), plus
   per-sample counts, after a small all-to-all of the payload sizes. Receiving ranks
   concatenate in source-rank order, which is global-sample order.
2. lookup: the owner pools its units over the global batch, one fused lookup per width
   (hybridrec.sparse.fused), giving [B, w_u] per unit.
3. output dist (one differentiable all_to_all_single of fp32): each unit's rows for rank p's
   samples go back to rank p, which rebuilds each table: the table-wise unit as is,
   column-wise slices concatenated in column order, row-wise partial sums added.
4. data-parallel tables are replicated: ids are all-gathered, every rank pools the global
   batch, keeps its slice, and in backward all-gathers the slice gradients, so every replica
   applies the same update as the reference.

Row-wise Adagrad keeps one statistic per row, mean(g^2) over the full width; a column shard
sees only its columns. So, when that optimizer meets column-wise tables, the backward adds one
small all-to-all (_FullRowStat): the owners of a table's column shards hold the same unique
rows in the same order, so each sends the others its per-row partial sums of g^2 and every
owner applies the full-row statistic, exactly as the unsharded table would.

Backward runs the exchanges in reverse (hybridrec.distributed.comm) and each owner's fused
group updates its rows with the gradients of the whole global batch. The output is scaled by
1/W in backward (gradient-scaling convention: hybridrec.parallelize).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hybridrec.distributed.comm import (
    AllToAllSingle,
    CommStats,
    LocalSlice,
    ScaleGrad,
    all_gather_rows,
    all_to_all,
    any_rank,
)
from hybridrec.sparse.collection import IdChecker, IdOutOfRangeError, pooling_scale
from hybridrec.sparse.fused import (
    FusedEmbedding,
    LookupInput,
    RowOptimizer,
    dedupe,
    regular_bags,
)
from hybridrec.types import ShardingPlan, ShardingType, ShardSpec, TableConfig, hot_offsets


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
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        self.group, self.stats = group, stats
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device(device)
        _check_plan(self.tables, plan, self.world)
        if len({t.dim for t in self.tables}) != 1:
            raise ValueError("all tables of a collection must share one embedding dim")
        self.offsets = hot_offsets(self.tables)
        self.checker = IdChecker(self.tables) if check_ids else None

        self.units_on: list[list[_Unit]] = [[] for _ in range(self.world)]
        self.table_units: dict[int, list[int]] = {}  # table -> positions in the received list
        self.dp_tables: list[int] = []
        for i, tp in enumerate(plan.tables):
            if tp.sharding == ShardingType.DATA_PARALLEL:
                self.dp_tables.append(i)
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
        self.width_on = [sum(u.shard.width for u in units) for units in self.units_on]

        # This rank's units, one fused group per width; slot[k] = (group key, index in group).
        self.local_units = self.units_on[self.rank]
        by_width: dict[int, list[int]] = {}
        for k, u in enumerate(self.local_units):
            by_width.setdefault(u.shard.width, []).append(k)
        self.slots: list[tuple[str, int]] = [("", 0)] * len(self.local_units)
        groups: dict[str, FusedEmbedding] = {}
        for w, ks in by_width.items():
            key = f"w{w}"
            shards = [
                (
                    self.local_units[k].table,
                    self.local_units[k].table_index,
                    self.local_units[k].shard,
                )
                for k in ks
            ]
            groups[key] = FusedEmbedding(shards, optimizer, seed, device)
            for pos, k in enumerate(ks):
                self.slots[k] = (key, pos)
        # Replicated tables: the full table on every rank, grouped by width the same way.
        dp_by_width: dict[int, list[int]] = {}
        for i in self.dp_tables:
            dp_by_width.setdefault(self.tables[i].dim, []).append(i)
        self.dp_group_tables = {f"dp_w{w}": idx for w, idx in dp_by_width.items()}
        for key, idx in self.dp_group_tables.items():
            shards = [(self.tables[i], i, plan.tables[i].shards[self.rank]) for i in idx]
            groups[key] = FusedEmbedding(shards, optimizer, seed, device)
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
        self.dp_cols = [
            c for i in self.dp_tables for c in range(self.offsets[i], self.offsets[i + 1])
        ]

    def plan_shards(self, table_index: int) -> tuple[ShardSpec, ...]:
        return self.plan.tables[table_index].shards

    # -- steps of forward -------------------------------------------------------------------
    def _check_ids(self, ids: torch.Tensor) -> None:
        """Every rank learns whether any rank saw a bad id, so all fail together (no hang)."""
        if self.checker is None:
            return
        bad = self.checker.bad_mask(ids)
        local_bad = bool(bad.any())
        if any_rank(local_bad, self.group, ids.device):
            if local_bad:
                self.checker.raise_first(ids, bad, sample_base=self.rank * ids.shape[0])
            raise IdOutOfRangeError(
                f"rank {self.rank}: another rank found an out-of-range id in this batch "
                "(that rank's error names the feature and the id)"
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
            torch.cat(chunks), out_splits, in_splits, self.group, self.stats, "input_dist"
        )
        return self._parse_ids(recv, out_splits, static_sizes, b_local)

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

    def _lookup(self, inputs: list[LookupInput]) -> list[torch.Tensor]:
        """One fused lookup per width group; returns [B, w_u] per local unit."""
        out: list[torch.Tensor | None] = [None] * len(inputs)
        for key, group in self.groups.items():
            ks = [k for k, (gk, _) in enumerate(self.slots) if gk == key]
            if not ks:
                continue
            for k, pooled in zip(ks, group([inputs[k] for k in ks]), strict=True):
                out[k] = pooled
        return out  # type: ignore[return-value]

    def _output_dist(self, pooled: list[torch.Tensor], b_local: int) -> list[torch.Tensor]:
        """Local units' [B, w_u] -> every unit's [B_l, w_u] for this rank's samples."""
        world = self.world
        if pooled:
            send = torch.cat([p.reshape(world, -1) for p in pooled], dim=1).reshape(-1)
        else:
            send = torch.zeros(0, device=self.device)
        if torch.is_grad_enabled() and not send.requires_grad:
            send = send.detach().requires_grad_()  # this rank must still join the backward a2a
        if torch.is_grad_enabled() and self.exchange_row_stats:
            send = _FullRowStat.apply(send, self, b_local)
        in_splits = [b_local * self.width_on[self.rank]] * world
        out_splits = [b_local * w for w in self.width_on]
        recv = AllToAllSingle.apply(
            send, out_splits, in_splits, self.group, self.stats, "output_dist"
        )
        units = []
        for q, chunk in enumerate(torch.split(recv, out_splits)):
            sizes = [b_local * u.shard.width for u in self.units_on[q]]
            for u, part in zip(self.units_on[q], torch.split(chunk, sizes), strict=True):
                units.append(part.view(b_local, u.shard.width))
        return units

    def _data_parallel(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """Replicated tables: all-gather ids, pool the global batch, keep this rank's slice."""
        if not self.dp_tables:
            return {}
        gathered = all_gather_rows(ids[:, self.dp_cols], self.group, self.stats, "dp_ids")
        batch = gathered.shape[0]
        col = {
            i: sum(self.tables[j].hotness for j in self.dp_tables[:n])
            for n, i in enumerate(self.dp_tables)
        }
        pooled: dict[int, torch.Tensor] = {}
        for key, idx in self.dp_group_tables.items():
            inputs = []
            for i in idx:
                t = self.tables[i]
                cols = gathered[:, col[i] : col[i] + t.hotness]
                inputs.append(
                    LookupInput(
                        cols.reshape(-1),
                        regular_bags(batch, t.hotness, ids.device),
                        batch,
                        pooling_scale(t),
                    )
                )
            pooled.update(zip(idx, self.groups[key](inputs), strict=True))
        stacked = torch.stack([pooled[i] for i in self.dp_tables], dim=1)
        local = LocalSlice.apply(stacked, self.group, self.stats, "dp_grads")
        return {i: local[:, n] for n, i in enumerate(self.dp_tables)}

    def shard_views(self) -> list[tuple[ShardSpec, torch.Tensor, dict[str, torch.Tensor]]]:
        """Every shard held here: (spec, weight view [rows, width], optimizer-state views)."""
        return [view for group in self.groups.values() for view in group.shard_views()]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B_l, H] int64 -> pooled [B_l, T, D] fp32 (this rank's samples)."""
        self._check_ids(ids)
        b_local = ids.shape[0]
        inputs = self._input_dist(ids)
        self._inputs = inputs if self.exchange_row_stats else []
        received = self._output_dist(self._lookup(inputs), b_local)
        replicated = self._data_parallel(ids)
        per_table = []
        for i in range(len(self.tables)):
            if i in replicated:
                per_table.append(replicated[i])
                continue
            pieces = [received[p] for p in self.table_units[i]]
            if self.table_kind[i] == ShardingType.COLUMN_WISE:
                per_table.append(torch.cat(pieces, dim=1))
            else:  # table-wise: one piece; row-wise: partial sums, added in shard order
                total = pieces[0]
                for p in pieces[1:]:
                    total = total + p
                per_table.append(total)
        return ScaleGrad.apply(torch.stack(per_table, dim=1), 1.0 / self.world)


class _FullRowStat(torch.autograd.Function):
    """Identity on the output-dist send buffer; its backward (run on every rank right after
    the gradients of this rank's units arrive, before their optimizer updates) shares the
    per-row sums of g^2 among a column-split table's shard owners."""

    @staticmethod
    def forward(ctx, send, coll, b_local):  # type: ignore[override]  # noqa: ANN001
        ctx.coll, ctx.b_local = coll, b_local
        return send.view_as(send)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]  # noqa: ANN001
        coll: ShardedEmbeddingCollection = ctx.coll
        world, b_local = coll.world, ctx.b_local
        per_rank = grad.view(world, -1)  # row p: rank p's samples, units side by side
        partial: dict[int, torch.Tensor] = {}
        col = 0
        for k, u in enumerate(coll.local_units):
            width = u.shard.width * b_local
            if k in coll.peers:
                g_unit = per_rank[:, col : col + width].reshape(world * b_local, u.shard.width)
                inp = coll._inputs[k]
                _, g_rows = dedupe(inp.ids, inp.bags, inp.scale, g_unit)
                partial[k] = g_rows.pow(2).sum(dim=1)
            col += width
        sends = [[partial[k] for k in partial if q in coll.peers[k]] for q in range(world)]
        in_splits = [sum(p.numel() for p in parts) for parts in sends]
        out_splits = [
            sum(partial[k].numel() for k in partial if q in coll.peers[k]) for q in range(world)
        ]
        flat = (
            torch.cat([p for parts in sends for p in parts])
            if any(in_splits)
            else grad.new_zeros(0)
        )
        recv = all_to_all(flat, out_splits, in_splits, coll.group, coll.stats, "row_stats")
        received: dict[tuple[int, int], torch.Tensor] = {}
        for q, chunk in enumerate(torch.split(recv, out_splits)):
            ks = [k for k in partial if q in coll.peers[k]]
            for k, part in zip(
                ks, torch.split(chunk, [partial[k].numel() for k in ks]), strict=True
            ):
                received[(k, q)] = part
        for k, u in enumerate(coll.local_units):
            if k not in partial:
                continue
            total = None
            for s in coll.plan_shards(u.table_index):  # shard order: the same sum everywhere
                part = partial[k] if s.rank == coll.rank else received[(k, s.rank)]
                total = part if total is None else total + part
            key, pos = coll.slots[k]
            coll.groups[key].row_sq_override[pos] = total / u.table.dim
        return grad, None, None


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
