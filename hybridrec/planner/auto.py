"""Mode `auto`: replicate tiny tables, cut the rest as little as balance and fit allow.

`_plan_auto` plans tables on the devices in four steps: replicate tables of at most dp_max
bytes (`_replicate_tiny`); cut every other table into the fewest column slices that keep its
lookups within one rank's fair share and its widest slice within the free room, or into row
ranges when its width allows too few slices (`_Cuts.first_cut`); place the pieces greedily and
cut the fullest rank's largest piece until that rank is within BALANCE_TOLERANCE of the mean,
keeping the most balanced placement seen (`_balance`); then write each table's plan and reason
(`_auto_plan`). `_plan_auto_host` handles tables past the device budget: it moves the largest
to host memory behind device caches, one at a time, until the rest fits next to the caches.
Deterministic, like all of the planner; results depend only on the arguments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from hybridrec.planner.memory import rank_memory
from hybridrec.planner.placement import (
    MIN_COLUMN_WIDTH,
    _Base,
    _Context,
    _cw_plan,
    _dp_plan,
    _greedy,
    _needs_without_limit,
    _NoRoom,
    _Piece,
    _pieces,
    _plan_host,
    _rw_plan,
    table_row_ranges,
)
from hybridrec.planner.types import CachePolicy, PlannerError, human_bytes
from hybridrec.types import ShardingPlan, TableConfig, TablePlan

BALANCE_TOLERANCE = 0.10  # auto stops splitting once the fullest rank is within 10% of the mean
OVER_BUDGET = "> device budget: "  # reason prefix of the tables auto moved to host memory


def _plan_auto(
    tables: Sequence[TableConfig], ctx: _Context, dp_max: int, pinned: _Base | None = None
) -> dict[str, TablePlan]:
    """Replicate tiny tables, place the rest whole or in slices, refine until balanced.

    1. Tables with weights <= dp_max bytes are replicated: every rank pays for them (the base).
    2. Every other table starts as k column slices (k = 1: whole), k = the fewest slices such
       that no slice carries more than one rank's fair share of the lookup load
       (B * hotness * dim summed over these tables, / W) and the widest slice fits next to
       the base. Slices are >= 4 columns wide and on distinct ranks, so k <= min(W, dim // 4);
       a table that does not fit even so is cut into W row ranges (range i on rank i).
    3. Whole tables and slices are placed greedily (`_greedy`, memory and lookups balanced).
       While the fullest rank holds more than BALANCE_TOLERANCE (10%) over the mean, its
       largest piece that can still be cut is cut into one more slice and everything is placed
       again: a table much larger than the mean rank would otherwise set the peak on its own.
       A piece that finds no room is cut the same way. The most balanced placement seen is
       kept (a new one must lower the peak by more than 1%, so fewer cuts win near-ties).

    `pinned`: memory and load per rank of tables placed before (sharding.tables); the other
    tables are placed around them.
    """
    pinned = pinned or _Base.empty(ctx.world)
    tiny = [t for t in tables if _weights(t, ctx) <= dp_max and t.dynamic is None]
    rest = [t for t in tables if t not in tiny]
    plans, base = _replicate_tiny(tiny, ctx)
    cuts = _Cuts(ctx, base, pinned, room=ctx.budget - base - min(pinned.mem))
    fair_load = sum(ctx.batch * t.hotness * t.dim for t in rest) / ctx.world
    for t in rest:
        cuts.first_cut(t, fair_load)
    split, where = _balance(rest, cuts)
    for t in rest:
        plans[t.name] = _auto_plan(t, split[t.name], cuts, where)
    return plans


def _weights(table: TableConfig, ctx: _Context) -> int:
    return table.num_rows * table.dim * ctx.weight_bytes


def _replicate_tiny(tiny: Sequence[TableConfig], ctx: _Context) -> tuple[dict[str, TablePlan], int]:
    """Step 1: the replicated tables' plans, and the bytes they take on every rank."""
    base = sum(ctx.whole(t) for t in tiny)
    plans = {
        t.name: _dp_plan(t, ctx.world, f"tiny ({human_bytes(_weights(t, ctx))}): replicated")
        for t in tiny
    }
    if base > ctx.budget:
        raise PlannerError(
            f"auto: the {len(tiny)} replicated tables alone need {human_bytes(base)} per rank:",
            [base] * ctx.world,
            ctx.budget,
            "hint: lower data_parallel_max_bytes",
        )
    return plans, base


@dataclass
class _Cuts:
    """How auto cuts the tables it does not replicate, and what every rank starts from.

    `split[name]`: the number of column slices (1 = whole), 0 = row ranges over all ranks.
    `why[name]`: why the table is cut ("load", "fit" or "balance"), for its plan's reason.
    """

    ctx: _Context
    base: int  # bytes of the replicated tables, on every rank
    pinned: _Base  # memory and load of the tables placed before (sharding.tables)
    room: int  # the most any rank has free for one piece
    split: dict[str, int] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)

    def max_slices(self, t: TableConfig) -> int:
        return min(self.ctx.world, t.dim // MIN_COLUMN_WIDTH)

    def first_cut(self, t: TableConfig, fair_load: float) -> None:
        """Step 2: the fewest slices for the lookup load, then for the room; else row ranges."""
        # a piece never carries more than one rank's fair share of the lookups
        k_load = min(self.max_slices(t), math.ceil(self.ctx.batch * t.hotness * t.dim / fair_load))
        self.split[t.name] = max(1, k_load)
        if k_load > 1:
            self.why[t.name] = "load"
        if _pieces(t, self.split[t.name], self.ctx)[0].memory <= self.room:
            return
        self.why[t.name] = "fit"
        for k in range(self.split[t.name] + 1, self.max_slices(t) + 1):
            if _pieces(t, k, self.ctx)[0].memory <= self.room:
                self.split[t.name] = k
                return
        self.to_row_wise(t)

    def cut_once_more(self, t: TableConfig, why: str) -> bool:
        """One more column slice for `t` if its width allows; False if it does not."""
        if not 0 < self.split[t.name] < self.max_slices(t):
            return False
        self.split[t.name] += 1
        self.why.setdefault(t.name, why)
        return True

    def to_row_wise(self, t: TableConfig) -> None:
        ctx, world = self.ctx, self.ctx.world
        rw_piece = ctx.memory(t, table_row_ranges(t, world)[0][1], t.dim).total
        if rw_piece > self.room:
            raise PlannerError(
                f"auto: table {t.name!r} ({human_bytes(ctx.whole(t))}) does not fit even split "
                f"into {min(world, t.num_rows)} row ranges; needs per rank with one range:",
                [self.base + p + rw_piece for p in self.pinned.mem],
                ctx.budget,
                "hint: use more ranks or a larger budget",
            )
        self.split[t.name] = 0  # 0 = row-wise over all ranks

    def floor(self, tables: Sequence[TableConfig]) -> tuple[list[int], list[int]]:
        """Memory and load per rank before any piece: pinned, replicated and row-wise tables."""
        ctx = self.ctx
        base_mem, base_load = [self.base + p for p in self.pinned.mem], list(self.pinned.load)
        for t in tables:
            if self.split[t.name] != 0:
                continue
            for r, (a, b) in enumerate(table_row_ranges(t, ctx.world)):
                base_mem[r] += ctx.memory(t, b - a, t.dim).total
                base_load[r] += ctx.batch * t.hotness * t.dim * (b - a) // t.num_rows
        return base_mem, base_load

    def pieces(self, tables: Sequence[TableConfig]) -> list[_Piece]:
        """The whole tables and column slices to place (row-wise tables are in the floor)."""
        split = self.split
        return [p for t in tables if split[t.name] > 0 for p in _pieces(t, split[t.name], self.ctx)]


def _balance(
    tables: Sequence[TableConfig], cuts: _Cuts
) -> tuple[dict[str, int], dict[tuple[str, int], int]]:
    """Step 3: place the pieces; cut the fullest rank's largest piece (or a piece that found no
    room) once more and place again, until balanced. Returns the best (split, placement)."""
    ctx = cuts.ctx
    best: tuple[int, dict[str, int], dict[tuple[str, int], int]] | None = None
    for _ in range(sum(cuts.max_slices(t) + 2 for t in tables) + 1):
        base_mem, base_load = cuts.floor(tables)
        pieces = cuts.pieces(tables)
        try:
            where = _greedy(pieces, base_mem, base_load, ctx.budget)
        except _NoRoom as e:
            t = e.piece.table
            if cuts.cut_once_more(t, "fit"):
                continue
            if best is not None:
                break  # cutting further made packing fail: keep the best placement found
            if cuts.max_slices(t) < ctx.world and cuts.split[t.name] != 0:
                cuts.why[t.name] = "fit"
                cuts.to_row_wise(t)
                continue
            needs = _needs_without_limit(pieces, base_mem, base_load)
            raise PlannerError(
                f"auto: could not place table {t.name!r} (piece of "
                f"{human_bytes(e.piece.memory)}); {human_bytes(sum(needs))} in all for "
                f"{ctx.world} x {human_bytes(ctx.budget)}; needs per rank without a limit:",
                needs,
                ctx.budget,
                "hint: use more ranks or a larger budget",
            ) from None
        used = list(base_mem)
        for p in pieces:
            used[where[(p.table.name, p.index)]] += p.memory
        peak = max(used)
        if best is None or peak < best[0] * 0.99:  # must beat the best by 1%: fewer cuts win
            best = (peak, dict(cuts.split), where)
        if peak <= (1 + BALANCE_TOLERANCE) * sum(used) / ctx.world:
            break
        victim = _cuttable(pieces, where, used.index(peak), cuts.split, cuts.max_slices)
        if victim is None:
            break
        cuts.cut_once_more(victim, "balance")
    assert best is not None
    return best[1], best[2]


def _auto_plan(t: TableConfig, k: int, cuts: _Cuts, where: dict[tuple[str, int], int]) -> TablePlan:
    """Step 4: the plan of a table auto cut into `k` slices (0: row ranges), with its reason."""
    ctx, room = cuts.ctx, human_bytes(cuts.room)
    size = human_bytes(ctx.whole(t))
    if k == 0:
        return _rw_plan(
            t,
            ctx.world,
            f"{size} > {room} free per rank, dim {t.dim} allows {cuts.max_slices(t)} "
            f"slices of >= {MIN_COLUMN_WIDTH} cols: {min(ctx.world, t.num_rows)} row shards",
        )
    if k == 1:
        reason = f"{size} fits whole on rank {where[(t.name, 0)]}"
    elif cuts.why.get(t.name) == "fit":
        reason = f"{size} > {room} free per rank: {k} column shards"
    elif cuts.why.get(t.name) == "load":
        reason = f"{size}, hotness {t.hotness}: {k} column shards to even out lookups"
    else:
        reason = f"{size}: {k} column shards to even out rank memory"
    return _cw_plan(t, _pieces(t, k, ctx), where, reason)


def _cuttable(
    pieces: Sequence[_Piece],
    where: dict[tuple[str, int], int],
    rank: int,
    split: dict[str, int],
    max_slices: Callable[[TableConfig], int],
) -> TableConfig | None:
    """The table of the largest piece on `rank` that can still be cut into one more slice."""
    candidates = [
        p
        for p in pieces
        if where[(p.table.name, p.index)] == rank and 0 < split[p.table.name] < max_slices(p.table)
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda p: (-p.memory, p.table.name, p.index)).table


def _plan_auto_host(
    tables: Sequence[TableConfig],
    ctx: _Context,
    dp_max: int,
    cache: CachePolicy,
    base: _Base | None = None,
    pinned_host: Sequence[TableConfig] = (),
) -> dict[str, TablePlan]:
    """`auto` past the device budget: move the largest tables to host memory (with caches),
    one at a time, until the other tables fit on the devices next to those caches.
    `pinned_host` tables are in host memory from the start (sharding.tables); `base` is what
    tables pinned on the devices already take."""
    base = base or _Base.empty(ctx.world)
    by_name = {t.name: t for t in [*tables, *pinned_host]}
    movable = sorted(
        (t for t in tables if _weights(t, ctx) > dp_max),
        key=lambda t: (-ctx.whole(t), t.name),
    )
    host: list[TableConfig] = list(pinned_host)
    needs: list[int] = []
    for t in movable:
        host.append(t)
        host_plans = _plan_host(host, ctx, cache, OVER_BUDGET)
        use = _Base.of(host_plans.values(), by_name, ctx).plus(base).mem
        room = ctx.budget - max(use)
        needs = use
        if room <= 0:
            break  # the caches alone fill a rank: more host tables only add caches
        rest = [x for x in tables if x not in host]
        try:
            plans = _plan_auto(rest, replace(ctx, budget=room), dp_max) if rest else {}
        except PlannerError as e:
            needs = [u + n for u, n in zip(use, e.needs, strict=True)]
            continue
        plans.update(host_plans)
        mine = [*tables, *pinned_host]
        plan = ShardingPlan(ctx.world, tuple(plans[x.name] for x in mine))
        needs = [
            m.total + b
            for m, b in zip(
                rank_memory(plan, mine, ctx.batch, ctx.optimizer, ctx.weight_bytes),
                base.mem,
                strict=True,
            )
        ]
        if max(needs) <= ctx.budget:  # (replicas' gradient buffers count here too)
            return plans
    raise PlannerError(
        f"auto: the tables do not fit {ctx.world} x {human_bytes(ctx.budget)} of device memory "
        f"even with {len(host)} of them in host memory behind device caches; needs per rank:",
        needs or [0] * ctx.world,
        ctx.budget,
        "hint: lower sharding.cache_fraction / sharding.cache_gb, use more ranks or a larger "
        "budget",
    )
