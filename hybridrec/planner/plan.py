"""The planner's entry point: `plan_sharding(tables, topology, mode, ...) -> ShardingPlan`.

Checks the arguments, plans the tables pinned by `sharding.tables` first (each mode's rule
places the tables pinned to it, as row ranges and replicas; whole tables and column slices are
placed greedily around those), then lets `mode` (a mode of RULES, auto or host) plan the other
tables with the pinned ones' memory and lookups as each rank's starting point. Host tables,
pinned or not, are planned together so one cache budget covers them all. The finished plan is
checked against the per-rank budget with the memory model (`rank_memory`); a plan over it
raises PlannerError naming every rank.
Pure and deterministic: the same arguments give the same plan on every rank; tables keep
their input order. It logs one line (INFO, shown on rank 0) when the host caches' floor
makes a cache larger than sharding.cache_fraction or cache_gb ask.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from hybridrec.planner.auto import OVER_BUDGET, _plan_auto, _plan_auto_host
from hybridrec.planner.memory import rank_memory
from hybridrec.planner.placement import (
    _Base,
    _Context,
    _cw_plan,
    _dp_plan,
    _greedy,
    _NoRoom,
    _pieces,
    _plan_column_wise,
    _plan_host,
    _plan_table_wise,
    _rw_plan,
    raised_caches_note,
)
from hybridrec.planner.types import (
    NO_OPTIMIZER_STATE,
    CachePolicy,
    OptimizerFootprint,
    PlannerError,
    Topology,
    human_bytes,
)
from hybridrec.types import ShardingPlan, TableConfig, TablePlan, storage_tables

log = logging.getLogger("hybridrec")

# A mode's placement rule: (its tables, the context, what is placed already) -> their plans,
# each with its reason, which starts with "<mode>: " where it names the mode (a table pinned
# to the mode gets PINNED in its place).
Rule = Callable[[Sequence[TableConfig], _Context, _Base], dict[str, TablePlan]]


def _plan_row_wise(
    tables: Sequence[TableConfig], ctx: _Context, base: _Base
) -> dict[str, TablePlan]:
    """Every table split into one row range per rank (fewer for tables of fewer rows)."""
    world = ctx.world
    ranges = "row range"
    return {
        t.name: _rw_plan(t, world, f"row_wise: {_count(min(world, t.num_rows), ranges)}")
        for t in tables
    }


def _plan_data_parallel(
    tables: Sequence[TableConfig], ctx: _Context, base: _Base
) -> dict[str, TablePlan]:
    """Every table replicated on every rank."""
    why = f"data_parallel: replicated on {_count(ctx.world, 'rank')}"
    return {t.name: _dp_plan(t, ctx.world, why) for t in tables}


# Every sharding mode's rule, one per mode of hybridrec.types.MODE_TRAITS (what its tables
# mean at run time: the layout, the exchanges and the cost model read only that). A mode is
# its traits, its rule here and a conf/sharding/<mode>.yaml (docs/architecture.md).
RULES: dict[str, Rule] = {
    "table_wise": _plan_table_wise,
    "column_wise": _plan_column_wise,
    "row_wise": _plan_row_wise,
    "data_parallel": _plan_data_parallel,
}
# Modes whose tables are whole tables or column slices that the greedy placement puts on
# ranks: how many slices one table gets on W ranks. Tables pinned to these are placed
# together, largest piece first, around the tables pinned to the other modes, which those
# modes' rules place first.
SLICES: dict[str, Callable[[TableConfig, int], int]] = {
    "table_wise": lambda table, world: 1,
    "column_wise": lambda table, world: min(world, table.dim),
}
# the modes `plan_sharding` accepts when this module is imported (hybridrec-plan's --mode):
# every rule, auto and host. A rule added later is accepted too (plan_sharding reads RULES)
MODES = (*RULES, "auto", "host")
PINNED = "pinned by sharding.tables: "


def _modes() -> tuple[str, ...]:
    return (*RULES, "auto", "host")


def _pinned(tp: TablePlan) -> TablePlan:
    return replace(tp, reason=PINNED + tp.reason)


def _plan_pinned_device(
    tables: Sequence[TableConfig], pins: Mapping[str, str], ctx: _Context
) -> dict[str, TablePlan]:
    """Tables pinned to a device mode: each mode's rule places the tables pinned to it (in
    RULES order, each mode around the ones before), then the whole tables and column slices
    of the SLICES modes are placed greedily around those."""
    by_name = {t.name: t for t in tables}
    plans: dict[str, TablePlan] = {}
    base = _Base.empty(ctx.world)
    for mode, rule in RULES.items():
        mine = [t for t in tables if pins[t.name] == mode]
        if mode in SLICES or not mine:
            continue
        placed = {
            name: replace(tp, reason=tp.reason.removeprefix(f"{mode}: "))
            for name, tp in rule(mine, ctx, base).items()
        }
        plans.update(placed)
        base = base.plus(_Base.of(placed.values(), by_name, ctx))
    placed = [t for t in tables if pins[t.name] in SLICES]
    pieces = {t.name: _pieces(t, SLICES[pins[t.name]](t, ctx.world), ctx) for t in placed}
    try:
        where = _greedy([p for ps in pieces.values() for p in ps], base.mem, base.load, ctx.budget)
    except _NoRoom as e:
        t = e.piece.table
        raise PlannerError(
            f"sharding.tables: table {t.name!r} pinned {pins[t.name]} "
            f"({human_bytes(e.piece.memory)} per piece) fits on no rank next to the other "
            "pinned tables; needs per rank:",
            e.needs,
            ctx.budget,
            "hint: pin it column_wise or row_wise, or leave it to the planner",
        ) from None
    for t in placed:
        n = len(pieces[t.name])
        what = f"whole on rank {where[(t.name, 0)]}" if n == 1 else f"{n} column shards"
        plans[t.name] = _cw_plan(t, pieces[t.name], where, what)
    return {name: _pinned(tp) for name, tp in plans.items()}


def _check_pins(pins: Mapping[str, str], names: Sequence[str]) -> None:
    unknown = sorted(set(pins) - set(names))
    if unknown:
        raise ValueError(
            f"sharding.tables names unknown table(s) {', '.join(unknown)}; the tables are "
            f"{', '.join(names)}"
        )
    for name in names:
        allowed = (*RULES, "host")
        if name in pins and pins[name] not in allowed:
            raise ValueError(
                f"sharding.tables.{name}={pins[name]!r} is not one of: {', '.join(allowed)}"
            )


def plan_sharding(
    tables: Sequence[TableConfig],
    topology: Topology,
    mode: str,
    batch_size: int,
    optimizer: OptimizerFootprint = NO_OPTIMIZER_STATE,
    weight_bytes: int = 4,
    data_parallel_max_bytes: int = 1 << 20,
    cache: CachePolicy | None = None,
    pins: Mapping[str, str] | None = None,
) -> ShardingPlan:
    """Shard `tables` over `topology.world_size` ranks; tables keep their input order.

    `batch_size` is the global batch (samples per step over all ranks); `weight_bytes` is 4 for
    fp32 tables, 2 for fp16/bf16. `cache` sizes the device caches of host-resident tables:
    mode `host` puts every table there (default CachePolicy() when None); mode `auto` moves
    tables there only when they do not fit the devices, and only when `cache` is given.
    `pins` ({table: a mode of RULES, or host}, config `sharding.tables`) fixes some tables'
    sharding: they are planned first and `mode` plans the others around them (host tables, pinned or
    not, share one cache budget).
    Raises ValueError for bad arguments and PlannerError (a ValueError) when some rank would
    need more than `topology.hbm_bytes_per_rank`.
    """
    world = topology.world_size
    pins = dict(pins or {})
    tables = storage_tables(tables)  # features sharing a table: planned as that one table
    _check_arguments(tables, world, mode, batch_size, weight_bytes, pins)
    by_name = {t.name: t for t in tables}
    ctx = _Context(world, topology.hbm_bytes_per_rank, batch_size, optimizer, weight_bytes)
    on_device = [t for t in tables if t.name in pins and pins[t.name] != "host"]
    host = [
        t for t in tables if pins.get(t.name) == "host" or (mode == "host" and t.name not in pins)
    ]
    free = [t for t in tables if t.name not in pins and mode != "host"]
    plans = _plan_pinned_device(on_device, pins, ctx)
    base = _Base.of(plans.values(), by_name, ctx)
    if host and (mode != "auto" or free == []):
        host_plans = _plan_host(host, ctx, cache or CachePolicy())
        plans.update(host_plans)
        base = base.plus(_Base.of(host_plans.values(), by_name, ctx))
        host = []
    if mode in RULES:
        plans.update(RULES[mode](free, ctx, base))
    elif mode == "auto" and free:
        # one rank: a replica is the table whole on that rank, so place it like the others
        # (one fused group, no replica sync)
        dp_max = data_parallel_max_bytes if world > 1 else -1
        host_plans = _plan_host(host, ctx, cache or CachePolicy()) if host else {}
        try:
            with_host = base.plus(_Base.of(host_plans.values(), by_name, ctx))
            plans.update(_plan_auto(free, ctx, dp_max, with_host))
            plans.update(host_plans)
        except PlannerError:
            if cache is None:
                raise
            plans.update(_plan_auto_host(free, ctx, dp_max, cache, base, host))
    for t in tables:
        if pins.get(t.name) == "host":
            tp = plans[t.name]
            plans[t.name] = _pinned(replace(tp, reason=tp.reason.removeprefix(OVER_BUDGET)))

    plan = ShardingPlan(world, tuple(plans[t.name] for t in tables))
    _check_fits(plan, tables, mode, ctx)
    note = raised_caches_note(plan.tables, tables, ctx, cache or CachePolicy())
    if note is not None:  # the request was not what the run gets: say so, and why
        log.info(note)
    return plan


def _check_arguments(
    tables: Sequence[TableConfig],
    world: int,
    mode: str,
    batch_size: int,
    weight_bytes: int,
    pins: Mapping[str, str],
) -> None:
    if mode not in _modes():
        raise ValueError(f"unknown sharding mode {mode!r}; allowed: {', '.join(_modes())}")
    if batch_size < 1 or batch_size % world != 0:
        raise ValueError(
            f"batch_size must be a positive multiple of world_size {world}, got {batch_size}"
        )
    if weight_bytes < 1:
        raise ValueError(f"weight_bytes must be >= 1, got {weight_bytes}")
    names = [t.name for t in tables]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"duplicate table names: {duplicates}")
    _check_pins(pins, names)


def _check_fits(
    plan: ShardingPlan, tables: Sequence[TableConfig], mode: str, ctx: _Context
) -> None:
    """The finished plan against the budget, with the memory model's numbers (replicas'
    gradient-sync buffers included)."""
    needs = [m.total for m in rank_memory(plan, tables, ctx.batch, ctx.optimizer, ctx.weight_bytes)]
    if max(needs, default=0) > ctx.budget:
        over = sum(n > ctx.budget for n in needs)
        raise PlannerError(
            f"{mode}: plan does not fit: {over} of {ctx.world} ranks over budget:",
            needs,
            ctx.budget,
            "hint: use more ranks, a larger budget, fewer bytes per weight, or mode auto"
            if mode != "auto"
            else "hint: use more ranks or a larger budget",
        )


def _count(n: int, noun: str) -> str:
    """(1, 'rank') -> '1 rank', (3, 'rank') -> '3 ranks'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")
