"""What one rank runs on its own shards: per-unit lookups and the sample-major fast path.

Tables (or shards) are fused into one group per width (hybridrec.sparse.fused). When one group
holds every table whole and in order (equal widths, one process: every DLRM), its bags are
numbered sample-major so its output already is [B, T, D]: no split, stack or cat in either
pass, and each row's ids still come in sample order, so sums and updates equal the per-unit
path bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridrec.sparse.bags import pooling_scale
from hybridrec.sparse.dist.row_stats import RowStats
from hybridrec.sparse.fused import FusedEmbedding, LookupInput, RowOptimizer
from hybridrec.sparse.host import HostCachedEmbedding
from hybridrec.sparse.layout import ShardedLayout
from hybridrec.types import CACHE_HALFLIFE, ShardSpec, TableConfig


def full_shard(table: TableConfig, rank: int = 0) -> ShardSpec:
    return ShardSpec(table.name, rank, 0, table.num_rows, 0, table.dim)


@dataclass
class SampleMajorLayout:
    """Per column of ids [B, H]: the row offset of its table in the group, its table index,
    its pooling scale (None when all are 1); the number of tables T; and whether some
    columns are jagged (their PAD_ID entries are no ids: left out of rows and bags)."""

    num_tables: int
    row_offset: torch.Tensor
    table: torch.Tensor
    scale: torch.Tensor | None
    jagged: bool = False


def sample_major_layout(tables: Sequence[TableConfig], group: FusedEmbedding) -> SampleMajorLayout:
    """When one group holds every table, in order, a lookup can number its bags sample-major,
    bag (b, t) = b * T + t, following the ids' own [B, H] layout; its output [B * T, D] is
    then pooled [B, T, D] as it is, and the gradient arrives the same way: no per-table
    split, stack or cat in either pass (each would copy the whole [B, T, D] tensor). Each
    row's ids still come in sample order, so sums and updates match the per-table path bit
    for bit."""
    device = group.row_offsets.device
    cols = [(i, t) for i, t in enumerate(tables) for _ in range(t.hotness)]
    scales = [pooling_scale(t) for _, t in cols]
    return SampleMajorLayout(
        len(tables),
        torch.tensor([group.offsets_list[i] for i, _ in cols], device=device),
        torch.tensor([i for i, _ in cols], device=device),
        None
        if all(s == 1.0 for s in scales)
        else torch.tensor(scales, dtype=torch.float32, device=device),
        any(t.jagged for t in tables),
    )


def sample_major_rows(ids: torch.Tensor, layout: SampleMajorLayout) -> torch.Tensor:
    """ids [B, H] -> the group rows [N] they read, in the layout's order (N = B * H when no
    column is jagged; else the ids >= 0)."""
    rows = (ids + layout.row_offset).reshape(-1)
    return rows[ids.reshape(-1) >= 0] if layout.jagged else rows


def lookup_sample_major(
    ids: torch.Tensor,
    layout: SampleMajorLayout,
    group: FusedEmbedding,
    out_dtype: torch.dtype,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """ids [B, H] (checked) -> pooled [B, T, D] in out_dtype, through `group.lookup`; `rows`:
    sample_major_rows(ids, layout) when already made (a host cache knows the very tensor it
    prefetched)."""
    B, T = ids.shape[0], layout.num_tables
    first = torch.arange(B, device=ids.device).unsqueeze(1) * T
    bags = (first + layout.table).reshape(-1)
    scale = layout.scale
    if scale is not None:
        scale = scale.expand(B, -1).reshape(-1)
    if layout.jagged:
        present = ids.reshape(-1) >= 0
        bags = bags[present]
        scale = scale[present] if scale is not None else None
    if rows is None:
        rows = sample_major_rows(ids, layout)
    pooled = group.lookup(rows, bags, scale, B * T, out_dtype)
    return pooled.view(B, T, group.width)


@dataclass(frozen=True)
class HostOptions:
    """How host-resident groups keep their rows (sharding.pin_host, host_copy, cache_halflife)."""

    pin: bool = True
    copy: str = "auto"
    halflife: int = CACHE_HALFLIFE


def build_groups(
    layout: ShardedLayout,
    optimizer: RowOptimizer | None,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    host: HostOptions,
) -> nn.ModuleDict:
    """This rank's fused groups: one per key of `layout.group_units` (device "w<width>" or
    host-resident "h<width>" behind a device cache), then one per replicated width."""
    groups: dict[str, FusedEmbedding] = {}
    for key, ks in layout.group_units.items():
        units = [layout.local_units[k] for k in ks]
        shards = [(u.table, u.table_index, u.shard) for u in units]
        if key.startswith("h"):
            cache_rows = sum(u.shard.cache_rows for u in units)
            groups[key] = HostCachedEmbedding(
                shards,
                optimizer,
                cache_rows,
                seed,
                device,
                dtype,
                host.pin,
                age_every=host.halflife,
                copy=host.copy,
            )
        else:
            groups[key] = FusedEmbedding(shards, optimizer, seed, device, dtype)
    for key, idx in layout.dp_group_tables.items():
        shards = [(layout.tables[i], i, layout.plan.tables[i].shards[layout.rank]) for i in idx]
        groups[key] = FusedEmbedding(shards, optimizer, seed, device, dtype)
    return nn.ModuleDict(groups)


def lookup_units(
    inputs: list[LookupInput],
    groups: nn.ModuleDict,
    layout: ShardedLayout,
    row_stats: RowStats | None,
) -> list[torch.Tensor]:
    """One fused lookup per group; returns [B, w_u] per local unit. Groups whose column
    shards share row statistics get them from `row_stats` in their backward."""
    out: list[torch.Tensor | None] = [None] * len(inputs)
    for key, ks in layout.group_units.items():
        source = None
        if row_stats is not None and any(k in layout.peers for k in ks):
            source = functools.partial(row_stats.take, key)
        for k, pooled in zip(ks, groups[key]([inputs[k] for k in ks], source), strict=True):
            out[k] = pooled
    return out  # type: ignore[return-value]
