"""Mode auto: tiny tables replicated, the rest whole or cut, balanced; host memory past the
budget."""

from __future__ import annotations

import pytest

from hybridrec.plan_cli import load_tables
from hybridrec.planner import (
    CachePolicy,
    OptimizerFootprint,
    PlannerError,
    Topology,
    estimate_cost,
    format_plan,
    plan_sharding,
)
from hybridrec.planner.auto import BALANCE_TOLERANCE, _Cuts
from hybridrec.planner.placement import _Base, _Context
from hybridrec.types import ShardingType, TableConfig
from tests.unit.planner.cases import GIB, MIB, UNEVEN, check_plan, kaggle


def test_auto_replicates_tiny_tables_and_splits_a_table_too_big_for_one_rank():
    tables = [
        TableConfig("tiny", 100, 16),  # 6.4 KiB
        TableConfig("mid", 10_000, 16),
        TableConfig("large", 200_000, 64),  # 48.8 MiB of weights > 40 MiB budget
    ]
    topo = Topology(4, 40 * MIB)
    plan = plan_sharding(tables, topo, "auto", 64, data_parallel_max_bytes=64 << 10)
    check_plan(plan, tables, topo.hbm_bytes_per_rank, 64)
    assert plan.table("tiny").sharding is ShardingType.DATA_PARALLEL
    assert "replicated" in plan.table("tiny").reason
    assert plan.table("mid").sharding is ShardingType.TABLE_WISE
    large = plan.table("large")
    assert large.sharding is ShardingType.COLUMN_WISE and len(large.shards) >= 2
    assert all(s.width >= 4 and s.width % 4 == 0 for s in large.shards)
    assert "column shards" in large.reason


def test_auto_falls_back_to_row_wise_when_the_width_is_too_small():
    tables = [TableConfig("narrow", 4_000_000, 4)]  # 61 MiB, one column slice at most
    topo = Topology(4, 40 * MIB)
    plan = plan_sharding(tables, topo, "auto", 64)
    check_plan(plan, tables, topo.hbm_bytes_per_rank, 64)
    assert plan.table("narrow").sharding is ShardingType.ROW_WISE
    assert [s.rank for s in plan.table("narrow").shards] == [0, 1, 2, 3]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_auto_balances_kaggle(world):
    # Documented target: the fullest rank within BALANCE_TOLERANCE (10%) of the mean memory.
    # Lookups (rows x width gathered) stay within 25% of the mean.
    tables, batch = kaggle(), 65536 * 3
    topo = Topology(world, 75 * GIB)
    plan = plan_sharding(tables, topo, "auto", batch)
    check_plan(plan, tables, topo.hbm_bytes_per_rank, batch)
    cost = estimate_cost(plan, tables, topo, batch)
    mem = [r.total_bytes for r in cost.ranks]
    assert max(mem) <= (1 + BALANCE_TOLERANCE) * sum(mem) / world
    work = [r.lookup_s for r in cost.ranks]
    assert max(work) <= 1.25 * sum(work) / world
    # counting tables is not balancing: the big tables do not share ranks
    big = [tp for tp in plan.tables if tp.table in ("cat_2", "cat_11", "cat_20", "cat_15")]
    assert len({s.rank for tp in big for s in tp.shards}) == world


def test_auto_fits_nvidia_113b_example_on_8_ranks():
    """Criteo 1TB uncapped (largest table 292,775,614 x 128 fp32 = 150 GB) on 8 x 80 GB."""
    name, tables = load_tables("dlrm_1tb_uncapped")
    assert max(t.num_rows for t in tables) == 292_775_614
    topo = Topology(8, 75 * GIB)  # 80 GiB minus 5 GiB for the dense model and activations
    plan = plan_sharding(tables, topo, "auto", 65536)
    check_plan(plan, tables, topo.hbm_bytes_per_rank, 65536)
    assert plan.table("cat_19").sharding is ShardingType.COLUMN_WISE
    # and with 80 GB counted in decimal bytes, no reserve
    plan = plan_sharding(tables, Topology(8, 80 * 10**9), "auto", 65536)
    check_plan(plan, tables, 80 * 10**9, 65536)


def test_auto_moves_the_largest_tables_to_host_only_when_needed():
    topo = Topology(1, 200 * MIB)
    cache = CachePolicy(0.05)
    with pytest.raises(PlannerError):  # no cache policy: auto never uses host memory
        plan_sharding(UNEVEN, topo, "auto", 64)
    plan = plan_sharding(UNEVEN, topo, "auto", 64, cache=cache)
    check_plan(plan, UNEVEN, topo.hbm_bytes_per_rank, 64)
    on_host = [tp.table for tp in plan.tables if tp.shards[0].on_host]
    assert on_host == ["huge"]  # 2M x 64 x 4 = 488 MiB; the rest fits next to its cache
    assert plan.table("huge").reason.startswith("> device budget: host memory")
    # a budget that holds everything: nothing moves
    roomy = plan_sharding(UNEVEN, Topology(1, GIB), "auto", 64, cache=cache)
    assert not any(s.on_host for tp in roomy.tables for s in tp.shards)
    text = format_plan(plan, estimate_cost(plan, UNEVEN, topo, 64), UNEVEN)
    assert "0:all@host(cache 100K)" in text


def test_auto_with_host_still_fails_clearly_when_the_caches_do_not_fit():
    with pytest.raises(PlannerError, match="even with .* in host memory") as info:
        plan_sharding(UNEVEN, Topology(1, 2 * MIB), "auto", 64, cache=CachePolicy(0.5))
    assert "cache_fraction" in str(info.value)


def test_first_cut_splits_for_lookups_then_for_room_then_by_rows():
    ctx = _Context(4, GIB, 64, OptimizerFootprint(), 4)
    cuts = _Cuts(ctx, base=0, pinned=_Base.empty(4), room=10 * MIB)
    hot, cold = TableConfig("hot", 1000, 64, hotness=10), TableConfig("cold", 1000, 64)
    big = TableConfig("big", 100_000, 64)  # 24.4 MiB whole, 9.2 MiB in 3 slices
    narrow = TableConfig("narrow", 2_000_000, 4)  # one slice at most: 4 row ranges of 7.6 MiB
    fair_load = 64 * (10 * 64 + 64 + 64 + 4) / 4
    for t in (hot, cold, big, narrow):
        cuts.first_cut(t, fair_load)
    assert cuts.split == {"hot": 4, "cold": 1, "big": 3, "narrow": 0}
    assert cuts.why == {"hot": "load", "big": "fit", "narrow": "fit"}
    too_big = TableConfig("too_big", 8_000_000, 4)  # 30.5 MiB per row range
    with pytest.raises(PlannerError, match="'too_big' .* does not fit even split into 4 row"):
        cuts.first_cut(too_big, fair_load)
