"""Raw ids -> rows, between the input dist and the lookup, for every dynamic shard of a rank.

A dynamic table's shard is a fused group of its own (layout: "w<width>_d..."), so the group's
GroupInput carries raw ids (every feature of the table, every source rank: the step's whole
multiset of that shard's ids). In training its DynamicMap steps once on them (admits,
evicts), the rows it gave new ids start fresh (initial values from (seed, table, id), zeroed
optimizer state) before the lookup reads them, and the ids become rows; in evaluation the map
only looks up. Ids without a row go to their bucket's unknown row or leave their bag
(DynamicMap.resolve): bags stay non-decreasing, the output's bags are unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from hybridrec.sparse.dynamic.idmap import DynamicMap
from hybridrec.sparse.exchange.input import GroupInput, Routed
from hybridrec.sparse.fused import FusedEmbedding


def build_maps(layout, seed: int, device: torch.device) -> dict[str, DynamicMap]:  # noqa: ANN001
    """Group key -> the DynamicMap of the dynamic shard it stores (layout: ShardedLayout)."""
    out = {}
    for key, slots in layout.group_slots.items():
        [(i, shard)] = slots if "_d" in key else [(None, None)]
        if i is not None:
            out[key] = DynamicMap(layout.storage[i], i, shard, seed, device)
    return out


def remap_input(
    inp: GroupInput, dmap: DynamicMap, group: FusedEmbedding, training: bool
) -> GroupInput:
    """The GroupInput of raw ids -> the same lookup of the group's rows (see module doc)."""
    if training:
        stepped = dmap.step(inp.rows)
        if stepped.new_slots.numel():
            fresh = dmap.fresh_rows(stepped.new_ids, group.weight.dtype)
            group.reset_rows(stepped.new_slots, fresh)
        slots = stepped.slots
    else:
        slots = dmap.find(inp.rows)
        dmap.count_eval(slots)
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
