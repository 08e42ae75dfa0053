"""What one rank runs on its own shards: per-unit lookups and the sample-major fast path.

Tables (or shards) are fused into one group per width (hybridrec.sparse.fused). When one group
holds every table whole and in order (equal widths, one process: every DLRM), its bags are
numbered sample-major so its output already is [B, T, D]: no split, stack or cat in either
pass, and each row's ids still come in sample order, so sums and updates equal the per-unit
path bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridrec.sparse.bags import pooling_scale
from hybridrec.sparse.exchange.input import Routed
from hybridrec.sparse.exchange.row_stats import RowStats
from hybridrec.sparse.fused import FusedEmbedding, RowOptimizer
from hybridrec.sparse.host import HostCachedEmbedding, Prefetched
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


def sample_major_layout(
    tables: Sequence[TableConfig], row_offsets: Sequence[int], device: torch.device
) -> SampleMajorLayout:
    """When one group holds every table, in order, a lookup can number its bags sample-major,
    bag (b, t) = b * T + t, following the ids' own [B, H] layout; its output [B * T, D] is
    then pooled [B, T, D] as it is, and the gradient arrives the same way: no per-table
    split, stack or cat in either pass (each would copy the whole [B, T, D] tensor). Each
    row's ids still come in sample order, so sums and updates match the per-table path bit
    for bit. `row_offsets`: per feature, where its table's rows start in the group."""
    cols = [(i, t) for i, t in enumerate(tables) for _ in range(t.hotness)]
    scales = [pooling_scale(t) for _, t in cols]
    return SampleMajorLayout(
        len(tables),
        torch.tensor([row_offsets[i] for i, _ in cols], device=device),
        torch.tensor([i for i, _ in cols], device=device),
        None
        if all(s == 1.0 for s in scales)
        else torch.tensor(scales, dtype=torch.float32, device=device),
        any(t.jagged for t in tables),
    )


@dataclass(frozen=True)
class SampleMajorInputs:
    """A batch's lookup in the sample-major layout: group rows [N], bags [N] (b * T + t,
    non-decreasing) and per-id scales [N] or None; N = B * H, or the ids >= 0 if jagged."""

    rows: torch.Tensor
    bags: torch.Tensor
    scale: torch.Tensor | None


def sample_major_inputs(ids: torch.Tensor, layout: SampleMajorLayout) -> SampleMajorInputs:
    """ids [B, H] (checked) -> what the group's lookup reads, made once per batch (a host
    cache prefetches these very rows). Jagged columns: one pass finds the real ids."""
    B, H = ids.shape
    T = layout.num_tables
    if not layout.jagged:
        rows = (ids + layout.row_offset).reshape(-1)
        first = torch.arange(B, device=ids.device).unsqueeze(1) * T
        bags = (first + layout.table).reshape(-1)
        scale = layout.scale.expand(B, -1).reshape(-1) if layout.scale is not None else None
        return SampleMajorInputs(rows, bags, scale)
    flat = ids.reshape(-1)
    where = (flat >= 0).nonzero().squeeze(1)  # positions of the real ids, in sample order
    col = where.remainder(H)
    rows = flat.index_select(0, where) + layout.row_offset.index_select(0, col)
    bags = where.div(H, rounding_mode="floor") * T + layout.table.index_select(0, col)
    scale = layout.scale.index_select(0, col) if layout.scale is not None else None
    return SampleMajorInputs(rows, bags, scale)


def lookup_sample_major(
    ids: torch.Tensor,
    layout: SampleMajorLayout,
    group: FusedEmbedding,
    out_dtype: torch.dtype,
    inputs: SampleMajorInputs | None = None,
    prefetched: Prefetched | None = None,
) -> torch.Tensor:
    """ids [B, H] (checked) -> pooled [B, T, D] in out_dtype, through `group.lookup`;
    `inputs`: sample_major_inputs(ids, layout) when already made (by the prefetch), with
    what the group's prefetch admitted for their rows (`prefetched`)."""
    B, T = ids.shape[0], layout.num_tables
    if inputs is None:
        inputs = sample_major_inputs(ids, layout)
    pooled = group.lookup(
        inputs.rows, inputs.bags, inputs.scale, B * T, out_dtype, prefetched=prefetched
    )
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
    for key, slots in layout.group_slots.items():
        shards = [(layout.storage[i], i, shard) for i, shard in slots]
        inputs = layout.input_slots(key)
        if key.startswith("h"):
            cache_rows = sum(shard.cache_rows for _, shard in slots)
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
                input_slots=inputs,
            )
        else:
            groups[key] = FusedEmbedding(shards, optimizer, seed, device, dtype, inputs)
    return nn.ModuleDict(groups)


def lookup_groups(
    routed: Routed,
    groups: nn.ModuleDict,
    layout: ShardedLayout,
    row_stats: RowStats | None,
    prefetched: Mapping[str, Prefetched],
) -> dict[str, torch.Tensor]:
    """One fused lookup per group, its bags in the output dist's send order: group key ->
    pooled [n_g, w_g]. Groups whose column shards share row statistics get them from
    `row_stats` in their backward; host groups what their prefetch admitted for these rows
    (`prefetched`, by group key; none for a batch not prefetched)."""
    out = {}
    for key, inp in routed.groups.items():
        source = None
        if row_stats is not None and any(k in layout.peers for k in layout.group_units[key]):
            source = functools.partial(row_stats.take, key)
        out[key] = groups[key].lookup(
            inp.rows,
            inp.bags,
            inp.scale,
            inp.num_bags,
            row_sq=source,
            prefetched=prefetched.get(key),
        )
    return out
