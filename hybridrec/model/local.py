"""Unsharded embedding storage for scoring: one `nn.EmbeddingBag` per table, in this process.

`LocalTables(features)` implements the storage forward that EmbeddingTables.attach expects:
ids [B, H] (each feature's columns in order, a list feature's padded with -1) -> pooled
[B, F, D] when every feature has one width D, else [B, sum_f D_f] (features in order), the
same function the trainer's sharded storage computes, without sharding, fused groups or a
sparse optimizer (no gradient reaches the rows). `attach_local(model)` gives every
declaration of a model one, so an exported model (hybridrec.model.inference) scores as plain
PyTorch. A jagged bag pools only its ids >= 0 (mean divides by their number; an empty bag
gives zeros), as training does. Never imports torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hybridrec.model.tables import declared_tables, qualify
from hybridrec.types import Pooling, TableConfig, hot_offsets, storage_tables


def pool(weight: torch.Tensor, cols: torch.Tensor, t: TableConfig) -> torch.Tensor:
    """Feature `t`'s ids `cols` [B, hotness] pooled from its table's `weight` -> [B, D]."""
    if not t.jagged:
        return nn.functional.embedding_bag(cols, weight, mode=t.pooling.value)
    present = cols >= 0
    w = present.to(weight.dtype)
    pooled = nn.functional.embedding_bag(
        cols.clamp(min=0), weight, mode="sum", per_sample_weights=w
    )
    if t.pooling == Pooling.MEAN:
        pooled = pooled / w.sum(1, keepdim=True).clamp(min=1)
    return pooled


class LocalTables(nn.Module):
    """The tables of `features` (TableConfig per feature; shared tables once) as EmbeddingBags,
    `bags[<table>]`; forward(ids [B, H]) -> pooled (module docstring)."""

    def __init__(self, features: Sequence[TableConfig]) -> None:
        super().__init__()
        self.features = list(features)
        self.offsets = hot_offsets(self.features)
        self.one_width = len({f.dim for f in self.features}) == 1
        self.bags = nn.ModuleDict(
            {
                t.name: nn.EmbeddingBag(t.num_rows, t.dim, mode=t.pooling.value)
                for t in storage_tables(self.features)
            }
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        o = self.offsets
        pooled = [
            pool(self.bags[f.table_name].weight, ids[:, o[i] : o[i + 1]], f)
            for i, f in enumerate(self.features)
        ]
        return torch.stack(pooled, dim=1) if self.one_width else torch.cat(pooled, dim=1)


def attach_local(model: nn.Module) -> dict[str, nn.Parameter]:
    """Attach LocalTables to every EmbeddingTables of `model`; returns each table's weight by
    qualified name ("<namespace>.<table>", hybridrec.model.tables)."""
    weights = {}
    for path, tables in declared_tables(model):
        storage = LocalTables(tables.features)
        tables.attach(storage)
        for name, bag in storage.bags.items():
            weights[qualify(tables.prefix(path), name)] = bag.weight
    return weights
