"""Slicing and greedy placement, and the fixed modes: table_wise, column_wise, row_wise,
data_parallel and host (valid plans, their rules, balance, cache sizing, their errors)."""

from __future__ import annotations

import itertools
import pickle

import pytest

from hybridrec.planner import (
    MODES,
    CachePolicy,
    OptimizerFootprint,
    PlannerError,
    Topology,
    column_widths,
    host_memory,
    plan_sharding,
    row_ranges,
)
from hybridrec.planner.placement import _Context, _greedy, _NoRoom, _pieces
from hybridrec.sparse.costs import CACHE_META_BYTES
from hybridrec.types import ShardingType, TableConfig
from tests.unit.planner.cases import GIB, MIB, SGD, TINY, UNEVEN, check_plan


def test_column_widths_prefer_multiples_of_four():
    assert column_widths(16, 3) == [8, 4, 4]
    assert column_widths(128, 3) == [44, 44, 40]
    assert column_widths(128, 8) == [16] * 8
    assert column_widths(10, 3) == [4, 3, 3]  # 10 is not a multiple of 4: plain even split
    assert column_widths(8, 4) == [2, 2, 2, 2]  # not enough columns for width-4 slices
    for dim, k in itertools.product([1, 3, 4, 16, 17, 128], [1, 2, 3, 5, 8]):
        if k <= dim:
            widths = column_widths(dim, k)
            assert sum(widths) == dim and len(widths) == k and max(widths) - min(widths) <= 4


def test_row_ranges_first_ranges_get_the_extra_rows():
    assert row_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert row_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_mode_gives_a_valid_plan(mode, world):
    batch = 12 * world
    topo = Topology(world, hbm_bytes_per_rank=64 * MIB)
    plan = plan_sharding(TINY, topo, mode, batch, OptimizerFootprint.for_optimizer("adam"))
    check_plan(plan, TINY, topo.hbm_bytes_per_rank, batch, OptimizerFootprint(0, 8))
    assert plan.world_size == world
    if mode == "host":
        assert all(s.on_host for tp in plan.tables for s in tp.shards)
    elif mode != "auto":
        assert {tp.sharding for tp in plan.tables} == {ShardingType(mode)}
    if mode != "host":
        assert not any(s.on_host for tp in plan.tables for s in tp.shards)


def test_strict_modes_follow_their_rules():
    topo = Topology(3, 1 * GIB)
    cw = plan_sharding(TINY, topo, "column_wise", 30)
    assert [s.width for s in cw.table("t0").shards] == [8, 4, 4]
    rw = plan_sharding(TINY, topo, "row_wise", 30)
    assert [(s.rank, s.row_start, s.row_end) for s in rw.table("t2").shards] == [
        (0, 0, 134),
        (1, 134, 267),
        (2, 267, 400),
    ]
    assert len(rw.table("t5").shards) == 3  # 4 rows over 3 ranks
    dp = plan_sharding(TINY, topo, "data_parallel", 30)
    assert all(len(tp.shards) == 3 for tp in dp.tables)
    tw = plan_sharding(TINY, topo, "table_wise", 30)
    assert all(tp.reason.startswith("fits whole on rank") for tp in tw.tables)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [2, 3])
def test_uneven_tables_on_uneven_world_sizes(mode, world):
    batch = 6 * 1024
    topo = Topology(world, hbm_bytes_per_rank=2 * GIB)
    plan = plan_sharding(UNEVEN, topo, mode, batch)
    check_plan(plan, UNEVEN, topo.hbm_bytes_per_rank, batch)


def test_table_wise_balances_memory_and_lookups():
    # Equal memory; the hot ones must not pile up on one rank.
    tables = [TableConfig(f"t{i}", 1000, 16, hotness=20 if i < 2 else 1) for i in range(4)]
    plan = plan_sharding(tables, Topology(2, GIB), "table_wise", 64)
    hot_ranks = {plan.table("t0").shards[0].rank, plan.table("t1").shards[0].rank}
    assert hot_ranks == {0, 1}


def test_table_wise_error_names_the_table_and_every_rank():
    tables = [TableConfig("small", 10, 8), TableConfig("whale", 1_000_000, 64)]
    with pytest.raises(PlannerError) as info:
        plan_sharding(tables, Topology(3, 100 * MIB), "table_wise", 48)
    msg = str(info.value)
    assert "'whale'" in msg and "column_wise" in msg and "row_wise" in msg and "auto" in msg
    for r in range(3):
        assert f"rank {r}: needs" in msg
    assert "bytes)" in msg and "100.0 MiB (104,857,600 bytes)" in msg
    assert len(info.value.needs) == 3 and info.value.budget == 100 * MIB
    assert all(n > 100 * MIB for n in info.value.needs)
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == msg


# --------------------------------------------------------------------------------------------
# Host-resident tables (sharding=host)


def test_host_mode_caches_a_fraction_never_below_two_batches():
    plan = plan_sharding(UNEVEN, Topology(1, GIB), "host", 64, cache=CachePolicy(0.01))
    check_plan(plan, UNEVEN, GIB, 64)
    cache = {tp.table: tp.shards[0].cache_rows for tp in plan.tables}
    # 1% of the rows, but at least two batches' ids (64 x hotness x 2), at most the table
    assert cache == {"huge": 20_000, "big": 3_000, "mid": 200, "small": 256, "tiny": 3}
    assert all(tp.reason.startswith("host memory, device cache") for tp in plan.tables)
    assert host_memory(plan, SGD, 4) == [sum(t.num_rows * t.dim * 4 for t in UNEVEN)]
    adam = OptimizerFootprint.for_optimizer("adam")
    assert host_memory(plan, adam, 2) == [sum(t.num_rows * t.dim * 10 for t in UNEVEN)]


def test_host_mode_on_three_ranks_splits_rows_and_sizes_caches_by_gb():
    plan = plan_sharding(UNEVEN, Topology(3, GIB), "host", 192, cache=CachePolicy(gb=0.01))
    check_plan(plan, UNEVEN, GIB, 192)
    huge = plan.table("huge")
    assert huge.sharding is ShardingType.ROW_WISE and [s.rank for s in huge.shards] == [0, 1, 2]
    # one fraction for every table, so that rank 0's caches take 0.01 GiB
    per_row = 64 * 4 + CACHE_META_BYTES  # fp32 row + its bookkeeping
    cached = sum(s.cache_rows for tp in plan.tables for s in tp.shards if s.rank == 0)
    assert cached * per_row == pytest.approx(0.01 * GIB, rel=0.02)


def test_greedy_keeps_slices_of_a_table_apart_and_names_a_piece_without_room():
    ctx = _Context(2, GIB, 8, SGD, 4)
    t = TableConfig("t", 1000, 16)
    pieces = _pieces(t, 2, ctx)
    assert [(p.col_start, p.col_end) for p in pieces] == [(0, 8), (8, 16)]
    # rank 1 is far fuller, yet the second slice may not join the first on rank 0
    where = _greedy(pieces, [0, 10**6], [0, 0], GIB)
    assert sorted(where.values()) == [0, 1] and where[("t", 0)] == 0
    with pytest.raises(_NoRoom) as info:
        _greedy(pieces, [0, 5], [0, 0], pieces[0].memory - 1)
    assert info.value.piece == pieces[0]
    assert info.value.needs == [pieces[0].memory, pieces[0].memory + 5]
