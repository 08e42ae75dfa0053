"""Tables and checks shared by the planner tests.

A valid plan covers every table's rows x columns exactly once (data-parallel tables: one full
replica per rank), never puts two column slices of one table on one rank, and keeps every
rank's memory under the budget (`check_plan`).
"""

from __future__ import annotations

import itertools

from hybridrec.plan_cli import load_tables
from hybridrec.planner import OptimizerFootprint, rank_memory
from hybridrec.types import ShardingPlan, ShardingType, ShardSpec, TableConfig, TablePlan

GIB = 1 << 30
MIB = 1 << 20
SGD = OptimizerFootprint()

TINY = [
    TableConfig("t0", 5000, 16),
    TableConfig("t1", 1200, 16, hotness=2),
    TableConfig("t2", 400, 16),
    TableConfig("t3", 100, 16, hotness=3),
    TableConfig("t4", 20, 16),
    TableConfig("t5", 4, 16),
]
# five tables of very different sizes (3 rows to 2M rows), for uneven world sizes
UNEVEN = [
    TableConfig("huge", 2_000_000, 64),
    TableConfig("big", 300_000, 64, hotness=4),
    TableConfig("mid", 20_000, 64),
    TableConfig("small", 700, 64, hotness=2),
    TableConfig("tiny", 3, 64),
]


def kaggle() -> list[TableConfig]:
    return load_tables("dlrm_kaggle")[1]


def check_plan(
    plan: ShardingPlan,
    tables: list[TableConfig],
    budget: int,
    batch: int,
    optimizer: OptimizerFootprint = SGD,
    weight_bytes: int = 4,
) -> None:
    """Coverage, distinct ranks for column slices, and the budget on every rank."""
    assert [tp.table for tp in plan.tables] == [t.name for t in tables]
    for tp, t in zip(plan.tables, tables, strict=True):
        assert tp.reason
        for s in tp.shards:
            assert s.table == t.name and 0 <= s.rank < plan.world_size
            assert 0 <= s.row_start < s.row_end <= t.num_rows
            assert 0 <= s.col_start < s.col_end <= t.dim
        if tp.sharding is ShardingType.DATA_PARALLEL:
            assert [s.rank for s in tp.shards] == list(range(plan.world_size))
            assert all((s.num_rows, s.width) == (t.num_rows, t.dim) for s in tp.shards)
            continue
        assert sum(s.num_rows * s.width for s in tp.shards) == t.num_rows * t.dim
        for a, b in itertools.combinations(tp.shards, 2):
            rows_overlap = a.row_start < b.row_end and b.row_start < a.row_end
            cols_overlap = a.col_start < b.col_end and b.col_start < a.col_end
            assert not (rows_overlap and cols_overlap), (a, b)
        if tp.sharding is ShardingType.COLUMN_WISE:
            ranks = [s.rank for s in tp.shards]
            assert len(set(ranks)) == len(ranks), f"{t.name}: slices share a rank: {ranks}"
            cols = [(s.col_start, s.col_end) for s in tp.shards]
            assert cols == sorted(cols)
        if tp.sharding is ShardingType.TABLE_WISE:
            assert len(tp.shards) == 1
    needs = [m.total for m in rank_memory(plan, tables, batch, optimizer, weight_bytes)]
    assert max(needs) <= budget, needs


def hand_plan() -> tuple[ShardingPlan, list[TableConfig]]:
    tables = [
        TableConfig("a", 10, 4, hotness=2),  # table-wise on rank 0
        TableConfig("b", 6, 8),  # column-wise: cols [0:4] on rank 0, [4:8] on rank 1
        TableConfig("c", 3, 4, hotness=3),  # data-parallel
    ]
    plan = ShardingPlan(
        2,
        (
            TablePlan("a", ShardingType.TABLE_WISE, (ShardSpec("a", 0, 0, 10, 0, 4),)),
            TablePlan(
                "b",
                ShardingType.COLUMN_WISE,
                (ShardSpec("b", 0, 0, 6, 0, 4), ShardSpec("b", 1, 0, 6, 4, 8)),
            ),
            TablePlan(
                "c",
                ShardingType.DATA_PARALLEL,
                (ShardSpec("c", 0, 0, 3, 0, 4), ShardSpec("c", 1, 0, 3, 0, 4)),
            ),
        ),
    )
    return plan, tables
