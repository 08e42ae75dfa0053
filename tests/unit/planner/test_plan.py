"""plan_sharding: argument checks, determinism, plans over budget, per-table pins."""

from __future__ import annotations

import pytest

from hybridrec.planner import (
    MODES,
    CachePolicy,
    OptimizerFootprint,
    PlannerError,
    Topology,
    plan_sharding,
)
from hybridrec.sparse.costs import CACHE_META_BYTES
from hybridrec.types import ShardingType, TableConfig
from tests.unit.planner.cases import GIB, MIB, TINY, UNEVEN, check_plan, kaggle


def test_plans_are_deterministic():
    tables = kaggle()
    topo = Topology(4, 75 * GIB)
    for mode in MODES:
        a = plan_sharding(tables, topo, mode, 65536)
        b = plan_sharding(list(tables), topo, mode, 65536)
        assert a == b and a.fingerprint() == b.fingerprint()
    # the placement does not depend on the order the tables come in, only on their names
    a = plan_sharding(tables, topo, "auto", 65536)
    b = plan_sharding(tables[::-1], topo, "auto", 65536)
    assert {tp.table: tp.shards for tp in a.tables} == {tp.table: tp.shards for tp in b.tables}


@pytest.mark.parametrize("mode", ["column_wise", "row_wise", "data_parallel", "auto"])
def test_too_big_for_the_cluster_raises_with_per_rank_numbers(mode):
    tables = [TableConfig("whale", 4_000_000, 64), TableConfig("other", 3_000_000, 64)]
    with pytest.raises(PlannerError) as info:
        plan_sharding(tables, Topology(2, 256 * MIB), mode, 64)
    assert len(info.value.needs) == 2
    assert "rank 0: needs" in str(info.value) and "rank 1: needs" in str(info.value)
    assert max(info.value.needs) > 256 * MIB


def test_bad_arguments():
    topo = Topology(4, GIB)
    with pytest.raises(ValueError, match="allowed: table_wise, column_wise"):
        plan_sharding(TINY, topo, "diagonal", 64)
    with pytest.raises(ValueError, match="multiple of world_size 4"):
        plan_sharding(TINY, topo, "auto", 66)
    with pytest.raises(ValueError, match="duplicate"):
        plan_sharding([TINY[0], TINY[0]], topo, "auto", 64)
    with pytest.raises(ValueError, match="sgd, rowwise_adagrad, adam, adagrad"):
        OptimizerFootprint.for_optimizer("lamb")
    with pytest.raises(ValueError, match="world_size"):
        Topology(0, GIB)
    assert OptimizerFootprint.for_optimizer("rowwise_adagrad") == OptimizerFootprint(4, 0)


# --------------------------------------------------------------------------------------------
# Per-table pins (sharding.tables)

PINNED = "pinned by sharding.tables: "


@pytest.mark.parametrize("mode", ["table_wise", "column_wise", "row_wise", "auto", "host"])
@pytest.mark.parametrize("world", [2, 3])
def test_pinned_tables_get_their_mode_and_the_rest_follow_the_mode(mode, world):
    pins = {"huge": "row_wise", "mid": "column_wise", "small": "data_parallel", "tiny": "host"}
    batch = 64 * world
    plan = plan_sharding(
        UNEVEN, Topology(world, GIB), mode, batch, cache=CachePolicy(0.05), pins=pins
    )
    check_plan(plan, UNEVEN, GIB, batch)
    assert plan.table("huge").sharding is ShardingType.ROW_WISE
    assert plan.table("mid").sharding is ShardingType.COLUMN_WISE
    assert len(plan.table("mid").shards) == world
    assert plan.table("small").sharding is ShardingType.DATA_PARALLEL
    assert all(s.on_host for s in plan.table("tiny").shards)
    assert all(plan.table(name).reason.startswith(PINNED) for name in pins)
    free = plan.table("big")
    assert not free.reason.startswith(PINNED)
    assert any(s.on_host for s in free.shards) == (mode == "host")
    unpinned = plan_sharding(UNEVEN, Topology(world, GIB), mode, batch, cache=CachePolicy(0.05))
    if mode in ("row_wise", "host"):  # fixed placements: pins of other tables change nothing
        assert free == unpinned.table("big")


def test_free_tables_are_placed_around_pinned_ones():
    tables = [
        TableConfig("a", 40_000, 64),
        TableConfig("b", 20_000, 64),
        TableConfig("c", 20_000, 64),
    ]
    plan = plan_sharding(tables, Topology(2, GIB), "table_wise", 64, pins={"a": "table_wise"})
    rank_a = plan.table("a").shards[0].rank
    assert [plan.table(n).shards[0].rank for n in ("b", "c")] == [1 - rank_a] * 2
    assert plan.table("a").reason == f"{PINNED}whole on rank {rank_a}"


def test_pinned_and_moved_host_tables_share_the_cache_budget():
    # auto past the budget: 'huge' moves to host next to the pinned 'tiny'; with cache_gb one
    # fraction covers both, so rank 0's caches still take cache_gb
    topo, cache = Topology(1, 200 * MIB), CachePolicy(gb=0.01)
    plan = plan_sharding(UNEVEN, topo, "auto", 64, cache=cache, pins={"mid": "host"})
    check_plan(plan, UNEVEN, topo.hbm_bytes_per_rank, 64)
    assert plan.table("mid").reason.startswith(f"{PINNED}host memory, device cache")
    assert plan.table("huge").reason.startswith("> device budget: host memory")
    per_row = 64 * 4 + CACHE_META_BYTES
    cached = sum(s.cache_rows for tp in plan.tables for s in tp.shards if s.on_host)
    assert cached * per_row == pytest.approx(0.01 * GIB, rel=0.02)


def test_bad_pins_are_named():
    topo = Topology(2, GIB)
    with pytest.raises(ValueError, match=r"unknown table\(s\) nope; the tables are huge, big"):
        plan_sharding(UNEVEN, topo, "auto", 64, pins={"nope": "row_wise"})
    with pytest.raises(ValueError, match=r"sharding.tables.big='rows' is not one of: table_wise"):
        plan_sharding(UNEVEN, topo, "auto", 64, pins={"big": "rows"})
    with pytest.raises(PlannerError, match="table 'huge' pinned table_wise .* fits on no rank"):
        plan_sharding(UNEVEN, Topology(2, 200 * MIB), "row_wise", 64, pins={"huge": "table_wise"})


def test_a_cache_the_floor_raises_is_logged_with_the_reason(caplog):
    """sharding.cache_fraction=0.1 of a 1,200-row table is 120 rows, fewer than two batches'
    ids (2 x 1,024): the cache holds the whole table. One INFO line says so and why, and the
    plan's reason names it; a fraction the floor leaves alone logs nothing."""
    tables = [TableConfig("big", 100_000, 8), TableConfig("small", 1200, 8)]
    with caplog.at_level("INFO", logger="hybridrec"):
        plan = plan_sharding(tables, Topology(1, GIB), "host", 1024, cache=CachePolicy(0.1))
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("host caches larger than sharding.cache_fraction=0.1 asks: small 100%")
    assert "big" not in line and "2 batches' ids" in line and "global batch of 1,024" in line
    assert plan.table("small").reason.endswith("(100%), raised to hold 2 batches' ids")
    assert plan.table("big").reason.endswith("device cache 10,000 rows (10%)")
    caplog.clear()
    with caplog.at_level("INFO", logger="hybridrec"):
        plan_sharding(tables[:1], Topology(1, GIB), "host", 1024, cache=CachePolicy(0.1))
        plan_sharding(tables, Topology(1, GIB), "table_wise", 1024, cache=CachePolicy(0.1))
    assert not caplog.records
    with caplog.at_level("INFO", logger="hybridrec"):  # with cache_gb: the fraction it gives
        plan_sharding(tables, Topology(1, GIB), "host", 1024, cache=CachePolicy(gb=0.0001))
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("host caches larger than sharding.cache_gb=0.0001 (")
