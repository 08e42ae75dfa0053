"""Sharding planner: which rank holds which rows and columns of every embedding table.

Pure and deterministic (no process group): plan on one rank, broadcast, and check that every
rank agrees with `ShardingPlan.fingerprint()`.

    plan = plan_sharding(tables, Topology(world_size=8, hbm_bytes_per_rank=75 << 30), "auto",
                         batch_size=65536)
    print(format_plan(plan, estimate_cost(plan, tables, topology, 65536), tables))
"""

from hybridrec.planner.cost import PlanCost, RankCost, estimate_cost
from hybridrec.planner.planner import (
    MODES,
    CachePolicy,
    MemoryUse,
    OptimizerFootprint,
    PlannerError,
    Topology,
    cache_row_bytes,
    column_widths,
    host_memory,
    human_bytes,
    plan_sharding,
    rank_memory,
    replica_sync,
    row_ranges,
    shard_memory,
)
from hybridrec.planner.report import format_plan

__all__ = [
    "MODES",
    "CachePolicy",
    "MemoryUse",
    "OptimizerFootprint",
    "PlanCost",
    "PlannerError",
    "RankCost",
    "Topology",
    "cache_row_bytes",
    "column_widths",
    "host_memory",
    "human_bytes",
    "estimate_cost",
    "replica_sync",
    "format_plan",
    "plan_sharding",
    "rank_memory",
    "row_ranges",
    "shard_memory",
]
