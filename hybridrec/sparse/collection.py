"""The single-process embedding collection: every table in this process, no process group.

This is the reference every sharding must equal. It is the sharded collection on a one-rank
plan (each table whole, table-wise on rank 0), so one process runs exactly the code one rank
of a sharded job runs: no separate path to keep equal by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridrec.sparse.fused import RowOptimizer
from hybridrec.sparse.layout import full_shard
from hybridrec.sparse.sharded import ShardedEmbeddingCollection
from hybridrec.types import ShardingPlan, ShardingType, TableConfig, TablePlan, storage_tables


def local_plan(tables: Sequence[TableConfig]) -> ShardingPlan:
    """Every table whole on rank 0 of a one-rank world (sharding=none); `tables` may be
    features (several sharing a table: one plan entry for it)."""
    return ShardingPlan(
        1,
        tuple(
            TablePlan(t.name, ShardingType.TABLE_WISE, (full_shard(t),), "one process")
            for t in storage_tables(tables)
        ),
    )


class EmbeddingCollection(ShardedEmbeddingCollection):
    """All T tables in this process, grouped by width into fused lookups."""

    def __init__(
        self,
        tables: Sequence[TableConfig],
        optimizer: RowOptimizer | None,
        seed: int = 0,
        device: torch.device | str = "cpu",
        check_ids: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(
            tables,
            local_plan(tables),
            None,
            optimizer,
            seed=seed,
            device=device,
            check_ids=check_ids,
            dtype=dtype,
        )
