"""The memory model, shard by shard and rank by rank (bytes worked out by hand)."""

from __future__ import annotations

from hybridrec.planner import (
    MemoryUse,
    OptimizerFootprint,
    cache_row_bytes,
    rank_memory,
    shard_memory,
)
from hybridrec.sparse.costs import CACHE_META_BYTES, SLOT_BYTES
from hybridrec.types import ShardingPlan, ShardingType, ShardSpec, TableConfig, TablePlan
from tests.unit.planner.cases import SGD

ADAM = OptimizerFootprint.for_optimizer("adam")


def test_a_device_shard_holds_its_rows_state_and_exchange_buffers():
    t = TableConfig("t", 1000, 16, hotness=2)
    # buffers for a global batch of 8: ids 8 x 2 x 8 bytes, pooled output and gradient
    # 2 x 8 x 16 x 4 bytes
    buffers = 8 * 2 * 8 + 2 * 8 * 16 * 4
    assert shard_memory(t, 1000, 16, 8, SGD, 4) == MemoryUse(1000 * 16 * 4, 0, buffers)
    assert shard_memory(t, 500, 8, 8, ADAM, 2) == MemoryUse(
        500 * 8 * 2, 500 * 8 * 8, 8 * 2 * 8 + 2 * 8 * 8 * 4
    )


def test_a_host_resident_shard_counts_only_its_cache_on_the_device():
    t = TableConfig("t", 1000, 16, hotness=2)
    buffers = 8 * 2 * 8 + 2 * 8 * 16 * 4
    mem = shard_memory(t, 1000, 16, 8, ADAM, 4, cache_rows=100)
    assert mem == MemoryUse(
        weights=100 * 16 * 4,
        optimizer=100 * 16 * 8,
        buffers=buffers + 1000 * SLOT_BYTES + 100 * CACHE_META_BYTES,
    )
    # per cached row: the row, its optimizer state and its bookkeeping
    assert cache_row_bytes(16, ADAM, 2) == 16 * 2 + 16 * 8 + CACHE_META_BYTES
    assert (mem.weights + mem.optimizer + 100 * CACHE_META_BYTES) == 100 * cache_row_bytes(
        16, ADAM, 4
    )


def test_rank_memory_counts_the_replica_sync_buffer_the_runtime_uses():
    # 1000 rows, each rank's 4 ids per step: all-gathering touched rows beats all-reducing
    # the table, so the buffer holds W x 4 rows of (width + 1) fp32
    t = TableConfig("d", 1000, 4)
    shards = tuple(ShardSpec("d", r, 0, 1000, 0, 4) for r in range(2))
    plan = ShardingPlan(2, (TablePlan("d", ShardingType.DATA_PARALLEL, shards),))
    shard = shard_memory(t, 1000, 4, 8, SGD, 4)
    assert rank_memory(plan, [t], 8, SGD, 4) == [shard + MemoryUse(buffers=2 * 4 * 5 * 4)] * 2
    # 3 rows: the dense [rows, width + 1] all-reduce buffer
    t = TableConfig("d", 3, 4)
    shards = tuple(ShardSpec("d", r, 0, 3, 0, 4) for r in range(2))
    plan = ShardingPlan(2, (TablePlan("d", ShardingType.DATA_PARALLEL, shards),))
    shard = shard_memory(t, 3, 4, 8, SGD, 4)
    assert rank_memory(plan, [t], 8, SGD, 4) == [shard + MemoryUse(buffers=3 * 5 * 4)] * 2
