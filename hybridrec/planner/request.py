"""What a plan is asked for besides the tables, and the one place it becomes a plan.

`hybridrec.parallelize` (and the trainer's `hybridrec.builder.make_plan` through it) and
`hybridrec-plan` each fill a `PlanRequest` from their own inputs (keyword arguments, the
config, the command line); `request.plan(features)` is then the only call of `plan_sharding`
outside the planner, and `request.cost(plan, features, ...)` the matching cost estimate, so
the plan a run makes and the plan hybridrec-plan prints cannot be assembled apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hybridrec.planner.cost import PlanCost, estimate_cost
from hybridrec.planner.plan import plan_sharding
from hybridrec.planner.types import NO_OPTIMIZER_STATE, CachePolicy, OptimizerFootprint, Topology
from hybridrec.sparse.costs import EMB_BYTES
from hybridrec.types import ShardingPlan, TableConfig


@dataclass(frozen=True)
class PlanRequest:
    """`plan_sharding`'s arguments but the tables (see its docstring), and mode "none".

    `mode`: a planner mode (hybridrec.planner.plan.RULES, auto, host) or "none", every table
    whole in one process (the single-process reference: planned table_wise on one rank).
    `pins`: {table: mode} (config `sharding.tables`).
    """

    topology: Topology
    mode: str
    batch_size: int
    optimizer: OptimizerFootprint = NO_OPTIMIZER_STATE
    weight_bytes: int = 4
    data_parallel_max_bytes: int = 1 << 20
    cache: CachePolicy | None = None
    pins: Mapping[str, str] = field(default_factory=dict)

    def plan(self, features: Sequence[TableConfig]) -> ShardingPlan:
        """The plan of `features` (a model's declared features, in order). ValueError
        (PlannerError included) for a request that cannot be planned or does not fit."""
        mode = self.mode
        if mode == "none":
            world = self.topology.world_size
            if world > 1:
                raise ValueError(
                    f"sharding=none keeps every table in one process, not {world} ranks"
                )
            mode = "table_wise"  # every table whole in this process
        return plan_sharding(
            features,
            self.topology,
            mode,
            self.batch_size,
            self.optimizer,
            self.weight_bytes,
            self.data_parallel_max_bytes,
            self.cache,
            self.pins,
        )

    def cost(
        self, plan: ShardingPlan, features: Sequence[TableConfig], comm_bytes: int = EMB_BYTES
    ) -> PlanCost:
        """`estimate_cost` of `plan` (made by this request) for the same cluster, batch and
        sizes; `comm_bytes`: bytes per pooled value in the output dist."""
        return estimate_cost(
            plan,
            features,
            self.topology,
            self.batch_size,
            self.optimizer,
            self.weight_bytes,
            comm_bytes,
        )
