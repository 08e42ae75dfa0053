"""Raw ids -> rows, between the input dist and the lookup, for every dynamic shard of a rank.

A dynamic table's shard is a fused group of its own (layout: "w<width>_d..."), so the group's
GroupInput carries raw ids (every feature of the table, every source rank: the step's whole
multiset of that shard's ids). In training its DynamicMap steps once on them (admits,
evicts), the rows it gave new ids start fresh (initial values from (seed, table, id), zeroed
optimizer state) before the lookup reads them, and the ids become rows; in evaluation the map
only looks up. Ids without a row go to their bucket's unknown row or leave their bag
(DynamicMap.resolve): bags stay non-decreasing, the output's bags are unchanged.

On one rank whose tables all fit one group (the sample-major layout, hybridrec.sparse.local),
dynamic tables share that group instead: their maps (keyed "<group>_t<slot>") turn their
columns of the batch's ids into rows before the group's lookup (`remap_columns`); an id
without a row becomes PAD_ID there, which the lookup leaves out of its bag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hybridrec.sparse.dynamic.idmap import DynamicMap
from hybridrec.sparse.exchange.input import GroupInput, Routed
from hybridrec.sparse.fused import FusedEmbedding
from hybridrec.types import PAD_ID


def build_maps(layout, seed: int, device: torch.device) -> dict[str, DynamicMap]:  # noqa: ANN001
    """Group key -> the DynamicMap of the dynamic shard it stores (layout: ShardedLayout);
    in a sample-major group, "<group>_t<slot position>" -> each dynamic table's."""
    out = {}
    for key, slots in layout.group_slots.items():
        if "_d" in key:
            [(i, shard)] = slots
            out[key] = DynamicMap(layout.storage[i], i, shard, seed, device)
        elif key == layout.sample_major_group:
            for pos, (i, shard) in enumerate(slots):
                if layout.storage[i].dynamic is not None:
                    out[f"{key}_t{pos}"] = DynamicMap(layout.storage[i], i, shard, seed, device)
    return out


@dataclass(frozen=True)
class ColumnMap:
    """A dynamic table in the sample-major group: its map's key, the columns [h] of a batch's
    ids [B, H] its features read, where its rows start in the group."""

    key: str
    columns: torch.Tensor
    offset: int
    jagged: bool  # some of its features are lists: their PAD_ID entries are no ids


def column_maps(layout, group: FusedEmbedding, device: torch.device) -> list[ColumnMap]:  # noqa: ANN001
    """The sample-major group's dynamic tables (layout: ShardedLayout)."""
    key = layout.sample_major_group
    out = []
    for pos, (i, _) in enumerate(layout.group_slots[key]):
        if layout.storage[i].dynamic is None:
            continue
        features = [f for f, j in enumerate(layout.storage_of) if j == i]
        cols = [
            c
            for f in features
            for c in range(layout.offsets[f], layout.offsets[f] + layout.tables[f].hotness)
        ]
        columns = torch.tensor(cols, dtype=torch.int64, device=device)
        jagged = any(layout.tables[f].jagged for f in features)
        out.append(ColumnMap(f"{key}_t{pos}", columns, group.offsets_list[pos], jagged))
    return out


def slots_of(
    ids: torch.Tensor, dmap: DynamicMap, group: FusedEmbedding, offset: int, training: bool
) -> torch.Tensor:
    """[N] the slots of raw ids [N] (-1: none). In training the map steps once on them
    (admits, evicts) and the rows it gave new ids start fresh in `group` (the map's rows start
    at `offset` there); in evaluation it only looks up, counting the ids without a row."""
    if not training:
        slots = dmap.find(ids)
        dmap.count_eval(slots)
        return slots
    stepped = dmap.step(ids)
    if stepped.new_slots.numel():
        fresh = dmap.fresh_rows(stepped.new_ids, group.weight.dtype)
        group.reset_rows(stepped.new_slots + offset, fresh)
    return stepped.slots


def remap_columns(
    ids: torch.Tensor,
    cmaps: list[ColumnMap],
    maps: Mapping[str, DynamicMap],
    group: FusedEmbedding,
    training: bool,
) -> torch.Tensor:
    """ids [B, H] with every dynamic table's columns turned from raw ids into its rows
    (PAD_ID: no row, under unknown "zeros"; PAD_ID entries of jagged columns stay): in
    training its map steps once on all of them (admits, evicts; the rows it gave new ids
    start fresh), in evaluation it only looks up. A new tensor; `ids` is not changed."""
    out = ids.clone()
    for cm in cmaps:
        dmap = maps[cm.key]
        flat = ids.index_select(1, cm.columns).reshape(-1)
        real = (flat != PAD_ID).nonzero().squeeze(1) if cm.jagged else None
        raw = flat.index_select(0, real) if real is not None else flat
        slots = slots_of(raw, dmap, group, cm.offset, training)
        if dmap.policy.unknown == "row":
            slots = dmap.resolve(raw, slots)[0]
        if real is not None:  # (slots' "no row" is -1: PAD_ID already)
            slots = torch.full_like(flat, PAD_ID).index_copy_(0, real, slots)
        out.index_copy_(1, cm.columns, slots.view(ids.shape[0], -1))
    return out


def remap_input(
    inp: GroupInput, dmap: DynamicMap, group: FusedEmbedding, training: bool
) -> GroupInput:
    """The GroupInput of raw ids -> the same lookup of the group's rows (see module doc)."""
    slots = slots_of(inp.rows, dmap, group, 0, training)
    rows, kept = dmap.resolve(inp.rows, slots)
    if kept is None:
        return dataclasses.replace(inp, rows=rows)
    scale = inp.scale.index_select(0, kept) if inp.scale is not None else None
    return dataclasses.replace(inp, rows=rows, bags=inp.bags.index_select(0, kept), scale=scale)


def remap(
    routed: Routed,
    maps: Mapping[str, DynamicMap],
    groups: Mapping[str, FusedEmbedding],
    training: bool,
) -> Routed:
    """`routed` with every dynamic group's raw ids mapped to rows (remap_input)."""
    if not maps:
        return routed
    out = dict(routed.groups)
    for key, dmap in maps.items():
        if key in out:
            out[key] = remap_input(out[key], dmap, groups[key], training)
    return dataclasses.replace(routed, groups=out)
