"""The planner and dynamic tables: row ranges own whole hash buckets at any world size, in
row_wise, host and auto plans; a dynamic table is never replicated (data_parallel refuses it
in one line, auto never picks it even when tiny); the runtime refuses a hand-made plan that
splits a bucket."""

from __future__ import annotations

import pytest

from hybridrec import Dynamic
from hybridrec.planner import CachePolicy, Topology, plan_sharding
from hybridrec.sparse.layout import check_plan
from hybridrec.types import ShardingPlan, ShardingType, ShardSpec, TableConfig, TablePlan

GIB = 1 << 30
DYN = TableConfig("users", 12 * 64, 8, dynamic=Dynamic(buckets=12))  # 64 rows per bucket
FIXED = TableConfig("ages", 100, 8)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("mode", ["row_wise", "host"])
def test_row_ranges_own_whole_buckets(world, mode):
    plan = plan_sharding([DYN, FIXED], Topology(world, GIB), mode, 420, cache=CachePolicy())
    shards = plan.tables[0].shards
    assert all(s.row_start % 64 == 0 and s.row_end % 64 == 0 for s in shards)
    assert [s.row_end - s.row_start for s in shards] == sorted(
        (s.row_end - s.row_start for s in shards), reverse=True
    )
    assert sum(s.num_rows for s in shards) == DYN.num_rows
    assert len(shards) == min(world, 12)


def test_a_dynamic_table_is_never_replicated():
    with pytest.raises(ValueError, match="dynamic table 'users' cannot be data_parallel"):
        plan_sharding([DYN, FIXED], Topology(2, GIB), "data_parallel", 64)
    plan = plan_sharding([DYN, FIXED], Topology(2, GIB), "auto", 64)  # both tiny
    kinds = {tp.table: tp.sharding for tp in plan.tables}
    assert kinds["ages"] == ShardingType.DATA_PARALLEL
    assert kinds["users"] != ShardingType.DATA_PARALLEL


def test_a_plan_splitting_a_bucket_is_refused():
    split = TablePlan(
        "users",
        ShardingType.ROW_WISE,
        (ShardSpec("users", 0, 0, 100, 0, 8), ShardSpec("users", 1, 100, 768, 0, 8)),
        "by hand",
    )
    with pytest.raises(ValueError, match=r"shard rows \[0, 100\) split a bucket of 64 rows"):
        check_plan([DYN], ShardingPlan(2, (split,)))


def test_a_dynamic_shard_counts_its_map_as_the_runtime_allocates_it():
    """The planner's memory for a dynamic shard adds its map: what the DynamicMap and its C
    index allocate (per-slot arrays, the index's entries, the step's marks), to the byte."""
    import torch

    from hybridrec.planner import shard_memory
    from hybridrec.planner.types import OptimizerFootprint
    from hybridrec.sparse.dynamic.idmap import DynamicMap

    fixed_twin = TableConfig("users", DYN.num_rows, 8)
    opt = OptimizerFootprint(0, 0)
    extra = (
        shard_memory(DYN, 768, 8, 64, opt, 4).buffers
        - shard_memory(fixed_twin, 768, 8, 64, opt, 4).buffers
    )
    dmap = DynamicMap(DYN, 0, ShardSpec("users", 0, 0, 768, 0, 8), seed=0)
    dmap.step(torch.arange(50))  # the C path makes its index and marks (on the CPU)
    if dmap._native is None:
        pytest.skip("no C compiler: the torch path's sorted index is smaller than the model")
    allocated = sum(b.numel() * b.element_size() for b in dmap.buffers())
    allocated += dmap._native.entries.numel() * 8 + dmap._busy.numel()
    assert extra == allocated > 768 * 52


@pytest.mark.parametrize("mode", ["table_wise", "row_wise", "host"])
def test_one_rank_reads_dynamic_tables_in_the_sample_major_group(mode):
    """On one rank with whole device tables of one width, dynamic tables join the one group
    that is looked up sample-major (their maps turn ids into rows first); a host-resident
    dynamic table is in a host group of its own kind (its rows are known only after the map,
    so they are not prefetched)."""
    from hybridrec.sparse.layout import GroupKey, Placement, ShardedLayout

    plan = plan_sharding([DYN, FIXED], Topology(1, GIB), mode, 420, cache=CachePolicy())
    layout = ShardedLayout.build([DYN, FIXED], plan, 0)
    if mode == "host":
        assert layout.sample_major_group is None
        assert GroupKey(Placement.HOST_DYNAMIC, 8) in layout.group_units
    else:
        key = GroupKey(Placement.DEVICE, 8)
        assert layout.sample_major_group == key and list(layout.group_units) == [key]
