"""A sharding mode is its traits, its rule and its conf file: a new one, added here exactly as
docs/architecture.md ("How to add", a sharding mode) says, is planned for every table and
pinned to some, sized, costed and printed by the planner from its traits alone, accepted by
the config, and trains on 2 gloo ranks equal to the single-process reference.

The mode, `row_interleaved`, cuts every table into 2W row ranges dealt round robin (range i
on rank i % W): each rank holds two ranges, which spreads the hot low rows of a skewed table
over every rank instead of leaving them all to rank 0. Its shards are row ranges whose
partial sums are added, a trait row_wise has already, so it needs no exchange code. The
recipe's steps are `added_mode` (types and planner) and `conf_dir` (the conf file); each
test removes them again.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from hybridrec.planner import (
    OptimizerFootprint,
    Topology,
    estimate_cost,
    format_plan,
    plan_sharding,
    rank_memory,
)
from hybridrec.planner.placement import _Base, _Context, table_row_ranges
from hybridrec.planner.plan import PINNED, RULES
from hybridrec.types import (
    MODE_TRAITS,
    ModeTraits,
    ShardingPlan,
    ShardingType,
    ShardSpec,
    TableConfig,
    TablePlan,
)
from tests.distributed.harness import run_shared
from tests.equivalence import cached_reference, compare, make_cfg, run_all
from tests.unit.planner.cases import GIB, UNEVEN, check_plan

MODE = "row_interleaved"


def _plan_row_interleaved(
    tables: Sequence[TableConfig], ctx: _Context, base: _Base
) -> dict[str, TablePlan]:
    """The mode's rule (hybridrec.planner.plan.RULES): every table in 2W row ranges (fewer
    for a table of fewer rows, or of fewer hash buckets), range i on rank i % W."""
    plans = {}
    for t in tables:
        ranges = table_row_ranges(t, 2 * ctx.world)
        shards = tuple(
            ShardSpec(t.name, i % ctx.world, a, b, 0, t.dim) for i, (a, b) in enumerate(ranges)
        )
        why = f"{MODE}: {len(ranges)} row ranges dealt over {ctx.world} ranks"
        plans[t.name] = TablePlan(t.name, ShardingType(MODE), shards, why)
    return plans


@contextlib.contextmanager
def added_mode() -> Iterator[None]:
    """The recipe's steps 1 and 2: the mode's traits in hybridrec.types.MODE_TRAITS and its
    rule in hybridrec.planner.plan.RULES (a source edit would add the same two entries)."""
    MODE_TRAITS[MODE] = ModeTraits(partial_sums=True)
    RULES[MODE] = _plan_row_interleaved
    try:
        yield
    finally:
        del MODE_TRAITS[MODE], RULES[MODE]


@pytest.fixture
def mode() -> Iterator[str]:
    with added_mode():
        yield MODE


@pytest.fixture
def conf_dir(tmp_path: Path) -> str:
    """The recipe's step 3, conf/sharding/row_interleaved.yaml, written to a directory that
    Hydra searches besides conf/ (the override to compose with)."""
    (tmp_path / "sharding").mkdir()
    (tmp_path / "sharding" / f"{MODE}.yaml").write_text(f"type: {MODE}\n")
    return f"hydra.searchpath=[file://{tmp_path}]"


def test_a_new_mode_plans_every_table_and_is_read_by_its_traits(mode):
    world, batch = 3, 192
    plan = plan_sharding(UNEVEN, Topology(world, GIB), mode, batch)
    check_plan(plan, UNEVEN, GIB, batch)
    for tp, t in zip(plan.tables, UNEVEN, strict=True):
        assert tp.sharding is ShardingType(mode) and tp.sharding.traits.partial_sums
        k = min(2 * world, t.num_rows)
        assert [s.rank for s in tp.shards] == [i % world for i in range(k)]
        assert tp.reason == f"{mode}: {k} row ranges dealt over 3 ranks"
    # the memory and cost models and the plan table read traits: the same shards named
    # row_wise cost, weigh and print the same, but for the mode's name
    same = ShardingPlan(
        world,
        tuple(dataclasses.replace(tp, sharding=ShardingType.ROW_WISE) for tp in plan.tables),
    )
    topo, adagrad = Topology(world, GIB), OptimizerFootprint(4, 0)
    cost = estimate_cost(plan, UNEVEN, topo, batch, adagrad)
    assert cost == estimate_cost(same, UNEVEN, topo, batch, adagrad)
    assert rank_memory(plan, UNEVEN, batch, adagrad, 4) == rank_memory(
        same, UNEVEN, batch, adagrad, 4
    )
    text = format_plan(plan, cost, UNEVEN)
    rows = [line for line in text.splitlines() if line.startswith("huge")]
    assert len(rows) == 1 and f"  {mode}  " in rows[0]


def test_a_new_mode_can_be_pinned(mode):
    pins = {"huge": mode, "mid": "column_wise", "tiny": "data_parallel"}
    plan = plan_sharding(UNEVEN, Topology(2, GIB), "table_wise", 128, pins=pins)
    check_plan(plan, UNEVEN, GIB, 128)
    huge = plan.table("huge")
    assert huge.sharding is ShardingType(mode)
    assert [s.rank for s in huge.shards] == [0, 1, 0, 1]
    assert huge.reason == f"{PINNED}4 row ranges dealt over 2 ranks"
    assert plan.table("mid").reason == f"{PINNED}2 column shards"
    assert plan.table("big").sharding is ShardingType.TABLE_WISE


def test_without_the_recipe_the_mode_is_refused_by_name():
    with pytest.raises(ValueError, match=f"sharding.tables.huge='{MODE}' is not one of"):
        plan_sharding(UNEVEN, Topology(2, GIB), "table_wise", 128, pins={"huge": MODE})
    with pytest.raises(ValueError, match=f"unknown sharding mode '{MODE}'"):
        plan_sharding(UNEVEN, Topology(2, GIB), MODE, 128)
    with pytest.raises(ValueError, match=f"sharding.tables.cat_4='{MODE}' is not one of"):
        make_cfg("table_wise", "sgd", 2, "sum", f"sharding.tables={{cat_4:{MODE}}}")


# the trained configurations: the mode pinned to two tables around a table_wise plan with a
# replicated table (config sharding.tables), and the mode for every table
# (sharding=row_interleaved: its conf file)
PINS = {"cat_4": MODE, "cat_2": MODE, "cat_0": "data_parallel"}


def _train(env, configs):  # noqa: ANN001, ANN202
    """Runs on every rank (a fresh process): the mode is added there the same way."""
    with added_mode():
        return run_all(env, configs)


@pytest.mark.slow
def test_a_new_mode_trains_pinned_and_whole_equal_to_the_reference(mode, conf_dir):
    world = 2
    pins = ",".join(f"{table}:{how}" for table, how in PINS.items())
    pinned = make_cfg("table_wise", "rowwise_adagrad", world, "sum", f"sharding.tables={{{pins}}}")
    assert pinned.sharding.tables == PINS
    whole = make_cfg(mode, "adam", world, "sum", conf_dir)
    assert whole.sharding.type == mode
    configs = [("pinned/rowwise_adagrad", pinned), ("whole/adam", whole)]
    results = run_shared(world, _train, configs)
    for name, cfg in configs:
        per_rank = [res[name] for res in results]
        plan = per_rank[0]["plan"]
        for table, how in (PINS if cfg is pinned else {"cat_4": mode}).items():
            assert plan.table(table).sharding == how
        rows = plan.table("cat_4").shards
        assert [s.rank for s in rows] == [0, 1, 0, 1], rows  # each rank two ranges
        ref = cached_reference(name.split("/")[1])
        compare(ref, per_rank, cfg, f"W={world} {MODE} {name}")
