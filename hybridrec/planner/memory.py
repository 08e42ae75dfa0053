"""The memory model: device bytes per shard and per rank, host bytes per rank.

Per rank, for every shard it stores (the same numbers `estimate_cost` reports):
- weights: rows x width x weight_bytes;
- optimizer: rows x (bytes_per_row + width x bytes_per_element) (`OptimizerFootprint`);
- buffers: the ids the shard receives for the global batch (B x hotness x 8) plus the pooled
  output and its gradient (2 x B x width x 4); a replicated table adds its gradient-sync
  buffer (`replica_sync`: a dense [rows, width + 1] one when all-reduced).
A host-resident shard (`cache_rows` > 0) counts on the device only its cache (cache rows x
(row + optimizer state + bookkeeping)) plus one cache slot per shard row and the buffers; its
rows and optimizer state count against the host (`host_memory`). A dynamic table's shard adds
its id -> slot map (`dynamic_map_bytes`) to its buffers. The byte sizes come from
`hybridrec.sparse.costs`, which the runtime allocates by, so model == measured.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from hybridrec.planner.types import MemoryUse, OptimizerFootprint
from hybridrec.sparse.costs import (
    CACHE_META_BYTES,
    EMB_BYTES,
    ID_BYTES,
    SLOT_BYTES,
    dynamic_map_bytes,
    replica_sync,
)
from hybridrec.types import ShardingPlan, TableConfig, storage_tables


def cache_row_bytes(width: int, optimizer: OptimizerFootprint, weight_bytes: int) -> int:
    """Device bytes per cached row: the row, its optimizer state and its bookkeeping."""
    return width * weight_bytes + optimizer.bytes_for(1, width) + CACHE_META_BYTES


def shard_memory(
    table: TableConfig,
    rows: int,
    width: int,
    batch_size: int,
    optimizer: OptimizerFootprint,
    weight_bytes: int,
    cache_rows: int = 0,
    outputs: int = 1,
) -> MemoryUse:
    """Device bytes for one shard (or one replica) of `table`: rows x width, serving the
    global batch, `outputs` rows per sample out (a pooled feature's one, a sequence's one per
    position). A host-resident shard (`cache_rows` > 0) holds only its cache here."""
    buffers = batch_size * table.hotness * ID_BYTES + 2 * batch_size * outputs * width * EMB_BYTES
    if table.dynamic is not None:  # its map (every column shard runs one)
        buffers += dynamic_map_bytes(rows)
    if cache_rows:
        return MemoryUse(
            weights=cache_rows * width * weight_bytes,
            optimizer=optimizer.bytes_for(cache_rows, width),
            buffers=buffers + rows * SLOT_BYTES + cache_rows * CACHE_META_BYTES,
        )
    return MemoryUse(
        weights=rows * width * weight_bytes,
        optimizer=optimizer.bytes_for(rows, width),
        buffers=buffers,
    )


def host_memory(plan: ShardingPlan, optimizer: OptimizerFootprint, weight_bytes: int) -> list[int]:
    """Host bytes each rank needs for its host-resident shards: weights and optimizer state."""
    use = [0] * plan.world_size
    for tp in plan.tables:
        for s in tp.shards:
            if s.on_host:
                use[s.rank] += s.num_rows * s.width * weight_bytes
                use[s.rank] += optimizer.bytes_for(s.num_rows, s.width)
    return use


def rank_memory(
    plan: ShardingPlan,
    tables: Sequence[TableConfig],
    batch_size: int,
    optimizer: OptimizerFootprint,
    weight_bytes: int,
) -> list[MemoryUse]:
    """Memory each rank of `plan` needs (index = rank), including the buffer that syncs
    replicated tables' gradients (a dense [rows, width + 1] one when they are all-reduced)."""
    by_name = {t.name: t for t in storage_tables(tables)}
    outputs = Counter()  # a table's output rows per sample: one per feature, L per sequence
    for t in tables:
        outputs[t.table_name] += t.slots
    use = [MemoryUse() for _ in range(plan.world_size)]
    b_local = batch_size // plan.world_size
    for tp in plan.tables:
        table = by_name[tp.table]
        for s in tp.shards:
            mem = shard_memory(
                table, s.num_rows, s.width, batch_size, optimizer, weight_bytes, s.cache_rows,
                outputs[tp.table],
            )  # fmt: skip
            if tp.sharding.traits.replicated:
                ids = b_local * table.hotness
                how, _ = replica_sync(s.num_rows, s.width, ids, plan.world_size)
                rows = s.num_rows if how == "all_reduce" else plan.world_size * min(s.num_rows, ids)
                mem = mem + MemoryUse(buffers=rows * (s.width + 1) * EMB_BYTES)
            use[s.rank] = use[s.rank] + mem
    return use
