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

from hybridrec.kernels.hashing import bucket_of
from hybridrec.kernels.probe import probe
from hybridrec.model.tables import declared_tables, qualify
from hybridrec.types import Pooling, TableConfig, hot_offsets, storage_tables


class DynamicRows(nn.Module):
    """A dynamic table's map for scoring: `slot_id` [rows] int64, the raw id each row holds
    (-1: none), as training left it (an export's `embeddings.<table>.slot_id`). Raw ids are
    looked up as evaluation looks them up (hybridrec.sparse.dynamic): an id without a row
    gets its hash bucket's unknown row (unknown="row") or adds zeros (it still counts in a
    mean, as in training). Never admits."""

    def __init__(self, table: TableConfig) -> None:
        super().__init__()
        assert table.dynamic is not None
        self.policy, self.size = table.dynamic, table.num_rows // table.dynamic.buckets
        self.register_buffer("slot_id", torch.full((table.num_rows,), -1, dtype=torch.int64))
        self._keys: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(held ids ascending, their rows), remade when slot_id was written."""
        version = self.slot_id._version
        if (
            self._keys is None
            or self._keys[0] != version
            or self._keys[1].device != self.slot_id.device
        ):
            rows = (self.slot_id >= 0).nonzero().squeeze(1)
            ids, order = torch.sort(self.slot_id.index_select(0, rows))
            self._keys = (version, ids, rows.index_select(0, order))
        return self._keys[1], self._keys[2]

    def forward(self, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cols [B, h] raw ids (-1: none) -> (rows [B, h] (0 where none), weights [B, h]: 1
        for an id with a row or an unknown row, 0 otherwise)."""
        flat = cols.reshape(-1)
        keys, rows = self.keys()
        slots = probe(keys, rows, flat.clamp(min=0))
        present = flat >= 0
        if self.policy.unknown == "row":
            unknown = bucket_of(flat.clamp(min=0), self.policy.buckets) * self.size + self.size - 1
            slots = torch.where(slots < 0, unknown, slots)
        weight = (present & (slots >= 0)).float()
        return slots.clamp(min=0).view_as(cols), weight.view_as(cols)


def pool(
    weight: torch.Tensor, cols: torch.Tensor, t: TableConfig, rows: DynamicRows | None = None
) -> torch.Tensor:
    """Feature `t`'s ids `cols` [B, hotness] pooled from its table's `weight` -> [B, D]
    (a dynamic table's raw ids first looked up by `rows`)."""
    if rows is not None:
        found, w = rows(cols)
        pooled = nn.functional.embedding_bag(found, weight, mode="sum", per_sample_weights=w)
        if t.pooling == Pooling.MEAN:  # over the ids present, as training's mean
            pooled = pooled / (cols >= 0).sum(1, keepdim=True).clamp(min=1)
        return pooled
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
        self.maps = nn.ModuleDict(
            {t.name: DynamicRows(t) for t in storage_tables(self.features) if t.dynamic}
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        o = self.offsets
        pooled = [
            pool(
                self.bags[f.table_name].weight,
                ids[:, o[i] : o[i + 1]],
                f,
                self.maps[f.table_name] if f.table_name in self.maps else None,
            )
            for i, f in enumerate(self.features)
        ]
        return torch.stack(pooled, dim=1) if self.one_width else torch.cat(pooled, dim=1)


def attach_local(model: nn.Module) -> dict[str, torch.Tensor]:
    """Attach LocalTables to every EmbeddingTables of `model`; returns each table's weight by
    qualified name ("<namespace>.<table>", hybridrec.model.tables), and each dynamic table's
    map as "<namespace>.<table>.slot_id"."""
    weights = {}
    for path, tables in declared_tables(model):
        storage = LocalTables(tables.features)
        tables.attach(storage)
        for name, bag in storage.bags.items():
            weights[qualify(tables.prefix(path), name)] = bag.weight
        for name, rows in storage.maps.items():
            weights[qualify(tables.prefix(path), name) + ".slot_id"] = rows.slot_id
    return weights
