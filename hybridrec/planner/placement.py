"""Slicing tables and placing the pieces on ranks; the fixed modes and host planning.

A piece is a whole table or one column slice (`_pieces`); `_greedy` places pieces largest
first on the rank that keeps memory and lookup load most even, never two slices of one table
on one rank and never over the budget, and raises `_NoRoom` for a piece that fits nowhere.
Row ranges and replicas have fixed ranks (`_rw_plan`, `_dp_plan`); tables placed before others
(pins, host tables) are a `_Base` of memory and load per rank that later pieces start from.
`_plan_table_wise`, `_plan_column_wise` and `_plan_host` are the modes built from these.
Deterministic: ties are broken by table name, slice index and rank number. The underscore
names are the planner package's own; `hybridrec.planner` exports none of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from hybridrec.planner.memory import cache_row_bytes, shard_memory
from hybridrec.planner.types import (
    GIB,
    CachePolicy,
    MemoryUse,
    OptimizerFootprint,
    PlannerError,
    human_bytes,
)
from hybridrec.types import ShardingType, ShardSpec, TableConfig, TablePlan

MIN_COLUMN_WIDTH = 4  # column slices are never cut narrower than this (vector loads, alignment)


def column_widths(dim: int, k: int) -> list[int]:
    """Widths of k column slices of a `dim`-wide table, as even as possible, wider ones first.

    When dim is a multiple of 4 with at least 4 columns per slice, the widths are multiples of
    4 (dim 16 over 3 -> 8, 4, 4; dim 128 over 3 -> 44, 44, 40); otherwise a plain even split
    (dim 10 over 3 -> 4, 3, 3).
    """
    assert 1 <= k <= dim, (dim, k)
    unit = MIN_COLUMN_WIDTH if dim % MIN_COLUMN_WIDTH == 0 and dim // MIN_COLUMN_WIDTH >= k else 1
    base, extra = divmod(dim // unit, k)
    return [unit * (base + 1)] * extra + [unit * base] * (k - extra)


def row_ranges(num_rows: int, k: int) -> list[tuple[int, int]]:
    """k contiguous [start, end) row ranges; the first num_rows % k get one extra row."""
    assert 1 <= k <= num_rows, (num_rows, k)
    base, extra = divmod(num_rows, k)
    ranges, start = [], 0
    for i in range(k):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def table_row_ranges(table: TableConfig, world: int) -> list[tuple[int, int]]:
    """A table's row ranges over up to `world` ranks (row_ranges); a dynamic table's fall on
    its hash buckets (each range owns whole buckets, so its owner decides for them alone)."""
    if table.dynamic is None:
        return row_ranges(table.num_rows, min(world, table.num_rows))
    buckets = table.dynamic.buckets
    size = table.num_rows // buckets
    return [(a * size, b * size) for a, b in row_ranges(buckets, min(world, buckets))]


# ----------------------------------------------------------------------------------------------
# Greedy placement of pieces (whole tables or column slices) on ranks.


@dataclass(frozen=True)
class _Piece:
    """A whole table or one column slice, waiting for a rank."""

    table: TableConfig
    index: int  # slice index within the table (0 for a whole table)
    col_start: int
    col_end: int
    memory: int  # bytes on its rank (weights + optimizer + buffers)
    load: int  # lookup load: batch_size * hotness * width


class _NoRoom(Exception):
    def __init__(self, piece: _Piece, needs: list[int]) -> None:
        super().__init__(piece.table.name)
        self.piece = piece
        self.needs = needs


def _pieces(table: TableConfig, k: int, ctx: _Context) -> list[_Piece]:
    pieces, start = [], 0
    for i, width in enumerate(column_widths(table.dim, k)):
        mem = ctx.memory(table, table.num_rows, width).total
        load = ctx.batch * table.hotness * width
        pieces.append(_Piece(table, i, start, start + width, mem, load))
        start += width
    return pieces


def _greedy(
    pieces: Sequence[_Piece], base_mem: Sequence[int], base_load: Sequence[int], capacity: float
) -> dict[tuple[str, int], int]:
    """Place pieces largest first (ties: table name, slice index) on the rank that keeps memory
    and lookup load most even, never two slices of one table on one rank, never over capacity.

    Score of a candidate rank, after adding the piece: max(memory / mean memory, load / mean
    load), then their sum, then the rank number (so ties are deterministic).
    Returns {(table name, slice index): rank}; raises _NoRoom for a piece that fits nowhere.
    """
    world = len(base_mem)
    mem, load = list(base_mem), list(base_load)
    mean_mem = max(1.0, (sum(mem) + sum(p.memory for p in pieces)) / world)
    mean_load = max(1.0, (sum(load) + sum(p.load for p in pieces)) / world)
    where: dict[tuple[str, int], int] = {}
    taken: dict[str, list[int]] = {}
    for p in sorted(pieces, key=lambda p: (-p.memory, p.table.name, p.index)):
        siblings = taken.setdefault(p.table.name, [])
        best = None
        for r in range(world):
            m, ld = mem[r] + p.memory, load[r] + p.load
            if r in siblings or m > capacity:
                continue
            key = (max(m / mean_mem, ld / mean_load), m / mean_mem + ld / mean_load, r)
            if best is None or key < best:
                best = key
        if best is None:
            raise _NoRoom(p, [m + p.memory for m in mem])
        r = best[2]
        mem[r] += p.memory
        load[r] += p.load
        siblings.append(r)
        where[(p.table.name, p.index)] = r
    return where


def _needs_without_limit(
    pieces: Sequence[_Piece], base_mem: Sequence[int], base_load: Sequence[int]
) -> list[int]:
    """Each rank's bytes when the same pieces are placed with no budget: for error messages."""
    where = _greedy(pieces, base_mem, base_load, math.inf)
    used = list(base_mem)
    for p in pieces:
        used[where[(p.table.name, p.index)]] += p.memory
    return used


@dataclass(frozen=True)
class _Context:
    world: int
    budget: int
    batch: int
    optimizer: OptimizerFootprint
    weight_bytes: int

    def memory(self, table: TableConfig, rows: int, width: int, cache_rows: int = 0) -> MemoryUse:
        return shard_memory(
            table, rows, width, self.batch, self.optimizer, self.weight_bytes, cache_rows,
            table.slots,
        )  # fmt: skip

    def whole(self, table: TableConfig) -> int:
        return self.memory(table, table.num_rows, table.dim).total


def _cw_plan(
    table: TableConfig, pieces: Sequence[_Piece], where: dict[tuple[str, int], int], reason: str
) -> TablePlan:
    shards = tuple(
        ShardSpec(
            table.name, where[(table.name, p.index)], 0, table.num_rows, p.col_start, p.col_end
        )
        for p in pieces
    )
    kind = ShardingType.TABLE_WISE if len(pieces) == 1 else ShardingType.COLUMN_WISE
    return TablePlan(table.name, kind, shards, reason)


def _rw_plan(table: TableConfig, world: int, reason: str) -> TablePlan:
    ranges = table_row_ranges(table, world)
    shards = tuple(ShardSpec(table.name, i, a, b, 0, table.dim) for i, (a, b) in enumerate(ranges))
    return TablePlan(table.name, ShardingType.ROW_WISE, shards, reason)


def _dp_plan(table: TableConfig, world: int, reason: str) -> TablePlan:
    if table.dynamic is not None:
        raise ValueError(
            f"dynamic table {table.name!r} cannot be data_parallel (replicas would admit ids "
            "apart); shard it table_wise, column_wise or row_wise"
        )
    shards = tuple(ShardSpec(table.name, r, 0, table.num_rows, 0, table.dim) for r in range(world))
    return TablePlan(table.name, ShardingType.DATA_PARALLEL, shards, reason)


class _Base(NamedTuple):
    """Device bytes and lookup load per rank already taken by tables placed before others."""

    mem: list[int]
    load: list[int]

    @staticmethod
    def empty(world: int) -> _Base:
        return _Base([0] * world, [0] * world)

    @staticmethod
    def of(plans: Iterable[TablePlan], tables: dict[str, TableConfig], ctx: _Context) -> _Base:
        base = _Base.empty(ctx.world)
        for tp in plans:
            t = tables[tp.table]
            for s in tp.shards:
                base.mem[s.rank] += ctx.memory(t, s.num_rows, s.width, s.cache_rows).total
                if not tp.sharding.traits.replicated:  # replicas look up locally
                    base.load[s.rank] += ctx.batch * t.hotness * s.width * s.num_rows // t.num_rows
        return base

    def plus(self, other: _Base) -> _Base:
        return _Base(
            [a + b for a, b in zip(self.mem, other.mem, strict=True)],
            [a + b for a, b in zip(self.load, other.load, strict=True)],
        )


# ----------------------------------------------------------------------------------------------
# The modes.


def _plan_table_wise(
    tables: Sequence[TableConfig], ctx: _Context, base: _Base | None = None
) -> dict[str, TablePlan]:
    pieces = {t.name: _pieces(t, 1, ctx) for t in tables}
    mem, load = base or _Base.empty(ctx.world)
    try:
        where = _greedy([p for ps in pieces.values() for p in ps], mem, load, ctx.budget)
    except _NoRoom as e:
        t, size = e.piece.table, e.piece.memory
        why = "is larger than one rank's budget" if size > ctx.budget else "fits on no rank left"
        raise PlannerError(
            f"table_wise: table {t.name!r} ({human_bytes(size)} with buffers) {why}; "
            "needs if placed on each rank:",
            e.needs,
            ctx.budget,
            "hint: use mode column_wise, row_wise or auto to split large tables",
        ) from None
    return {
        t.name: _cw_plan(t, pieces[t.name], where, f"fits whole on rank {where[(t.name, 0)]}")
        for t in tables
    }


def _plan_column_wise(
    tables: Sequence[TableConfig], ctx: _Context, base: _Base | None = None
) -> dict[str, TablePlan]:
    pieces = {t.name: _pieces(t, min(ctx.world, t.dim), ctx) for t in tables}
    mem, load = base or _Base.empty(ctx.world)
    try:
        where = _greedy([p for ps in pieces.values() for p in ps], mem, load, ctx.budget)
    except _NoRoom as e:
        all_pieces = [p for ps in pieces.values() for p in ps]
        raise PlannerError(
            f"column_wise: a column slice of table {e.piece.table.name!r} "
            f"({human_bytes(e.piece.memory)}) fits on no rank; needs per rank without a limit:",
            _needs_without_limit(all_pieces, mem, load),
            ctx.budget,
            "hint: use more ranks, a larger budget, or mode auto",
        ) from None
    plans = {}
    for t in tables:
        k = len(pieces[t.name])
        plans[t.name] = TablePlan(
            t.name,
            ShardingType.COLUMN_WISE,
            _cw_plan(t, pieces[t.name], where, "").shards,
            f"column_wise: {k} column shard{'s' if k > 1 else ''}",
        )
    return plans


def _host_fraction(
    tables: Sequence[TableConfig], ctx: _Context, cache: CachePolicy
) -> float | None:
    """With `cache.gb`: the one fraction of every host table's rows such that the fullest
    rank's caches take cache.gb GiB; else None (cache.fraction)."""
    if cache.gb is None:
        return None
    per_rank = [0] * ctx.world
    for t in tables:
        for r, (a, b) in enumerate(table_row_ranges(t, ctx.world)):
            per_rank[r] += (b - a) * cache_row_bytes(t.dim, ctx.optimizer, ctx.weight_bytes)
    return min(1.0, cache.gb * GIB / max(1, max(per_rank)))


def _plan_host(
    tables: Sequence[TableConfig], ctx: _Context, cache: CachePolicy, why: str = ""
) -> dict[str, TablePlan]:
    """Every table in host memory: on W ranks, row range i of each table on rank i, each
    range with its own device cache (sized by `cache`; with `cache.gb`, one fraction for all
    tables such that the fullest rank's caches take cache.gb GiB). A reason names a cache
    the floor (`cache.min_batches` batches' ids) made larger than asked."""
    fraction = _host_fraction(tables, ctx, cache)
    plans = {}
    for t in tables:
        ranges = table_row_ranges(t, ctx.world)
        ids = ctx.batch * t.hotness
        shards = tuple(
            ShardSpec(t.name, r, a, b, 0, t.dim, cache.rows(b - a, ids, fraction))
            for r, (a, b) in enumerate(ranges)
        )
        cached = sum(s.cache_rows for s in shards)
        kind = ShardingType.ROW_WISE if len(shards) > 1 else ShardingType.TABLE_WISE
        reason = (
            f"{why}host memory, device cache {cached:,} rows ({100 * cached / t.num_rows:.3g}%)"
        )
        if cached > sum(cache.asked(s.num_rows, fraction) for s in shards):
            reason += f", raised to hold {cache.min_batches} batches' ids"
        plans[t.name] = TablePlan(t.name, kind, shards, reason)
    return plans


def raised_caches_note(
    plans: Iterable[TablePlan], tables: Sequence[TableConfig], ctx: _Context, cache: CachePolicy
) -> str | None:
    """One line saying which host tables' caches the floor made larger than `cache` asks
    for, and why (None: none). `plans`: the finished plan's tables."""
    by_name = {t.name: t for t in tables}
    host = [tp for tp in plans if any(s.on_host for s in tp.shards)]
    fraction = _host_fraction([by_name[tp.table] for tp in host], ctx, cache)
    raised = []
    for tp in host:
        cached = sum(s.cache_rows for s in tp.shards)
        if cached > sum(cache.asked(s.num_rows, fraction) for s in tp.shards):
            raised.append(f"{tp.table} {100 * cached / by_name[tp.table].num_rows:.3g}%")
    if not raised:
        return None
    asked = (
        f"sharding.cache_fraction={cache.fraction:g}"
        if fraction is None
        else f"sharding.cache_gb={cache.gb:g} ({100 * fraction:.3g}% of rows)"
    )
    shown = ", ".join(raised[:8]) + (f" and {len(raised) - 8} more" if len(raised) > 8 else "")
    return (
        f"host caches larger than {asked} asks: {shown} of their rows; a cache holds at least "
        f"{cache.min_batches} batches' ids (one step's rows and the next step's prefetched "
        f"ones, at a global batch of {ctx.batch:,}) and at most the whole table"
    )
