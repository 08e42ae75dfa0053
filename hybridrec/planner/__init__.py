"""Sharding planner: which rank holds which rows and columns of every embedding table.

Pure and deterministic (no process group): plan on one rank, broadcast, and check that every
rank agrees with `ShardingPlan.fingerprint()`.

    plan = plan_sharding(tables, Topology(world_size=8, hbm_bytes_per_rank=75 << 30), "auto",
                         batch_size=65536)
    print(format_plan(plan, estimate_cost(plan, tables, topology, 65536), tables))
"""

from hybridrec.planner.cost import PlanCost, RankCost, estimate_cost
from hybridrec.planner.memory import cache_row_bytes, host_memory, rank_memory, shard_memory
from hybridrec.planner.placement import column_widths, row_ranges
from hybridrec.planner.plan import MODES, plan_sharding
from hybridrec.planner.report import format_plan
from hybridrec.planner.request import PlanRequest
from hybridrec.planner.types import (
    OPTIMIZERS,
    CachePolicy,
    MemoryUse,
    OptimizerFootprint,
    PlannerError,
    Topology,
    human_bytes,
)

__all__ = [
    "MODES",
    "OPTIMIZERS",
    "CachePolicy",
    "MemoryUse",
    "OptimizerFootprint",
    "PlanCost",
    "PlanRequest",
    "PlannerError",
    "RankCost",
    "Topology",
    "cache_row_bytes",
    "column_widths",
    "host_memory",
    "human_bytes",
    "estimate_cost",
    "format_plan",
    "plan_sharding",
    "rank_memory",
    "row_ranges",
    "shard_memory",
]
