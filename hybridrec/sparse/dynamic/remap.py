"""Raw ids -> rows, between the exchange and the lookup, for every dynamic slot of a rank.

A dynamic table's shard is a slot of its width's group like any other (hybridrec.sparse.groups),
but the exchange delivers its ids raw: the group's GroupInput lists where they are
(`raw`: slot position -> positions in `rows`, over every feature of the table and every
source rank, so the step's whole multiset of that shard's ids). In training the slot's
DynamicMap steps once on them (admits, evicts), the rows it gave new ids start fresh (initial
values from (seed, table, id), zeroed optimizer state) before the lookup reads them, and the
ids become the slot's rows; in evaluation the map only looks up. An id without a row goes to
its bucket's unknown row, or leaves its bag (DynamicMap.resolve): bags stay non-decreasing
and keep their numbers, so the output is laid out as without dynamic tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from hybridrec.sparse.dynamic.idmap import DynamicMap
from hybridrec.sparse.fused import FusedEmbedding
from hybridrec.sparse.groups import Group
from hybridrec.sparse.layout import GroupKey
from hybridrec.sparse.step import GroupInput, StepContext


def slots_of(
    ids: torch.Tensor, dmap: DynamicMap, store: FusedEmbedding, offset: int, training: bool
) -> torch.Tensor:
    """[N] the slots of raw ids [N] (-1: none). In training the map steps once on them
    (admits, evicts) and the rows it gave new ids start fresh in `store` (the map's rows start
    at `offset` there); in evaluation it only looks up, counting the ids without a row."""
    if not training:
        slots = dmap.find(ids)
        dmap.count_eval(slots)
        return slots
    stepped = dmap.step(ids)
    if stepped.new_slots.numel():
        fresh = dmap.fresh_rows(stepped.new_ids, store.weight.dtype)
        store.reset_rows(stepped.new_slots + offset, fresh)
    return stepped.slots


def map_group(inp: GroupInput, group: Group, training: bool) -> GroupInput:
    """A group's lookup with its dynamic slots' raw ids mapped to rows (see module doc)."""
    rows = inp.rows.clone()
    dropped = []
    for pos, at in inp.raw.items():
        dmap = group.map_at(pos)
        assert dmap is not None, f"slot {pos} of group {group.key} has no dynamic map"
        start = group.slot_rows[pos]
        raw = inp.rows.index_select(0, at)
        slots = slots_of(raw, dmap, group.store, start, training)
        local, kept = dmap.resolve(raw, slots)
        if kept is not None:  # ids without a row leave their bags
            dropped.append(at[slots < 0])
            at = at.index_select(0, kept)
        rows.index_copy_(0, at, local + start)
    if not dropped:
        return dataclasses.replace(inp, rows=rows, raw={})
    keep = torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)
    keep[torch.cat(dropped)] = False
    idx = keep.nonzero().squeeze(1)
    scale = inp.scale.index_select(0, idx) if inp.scale is not None else None
    return dataclasses.replace(  # the bags stay: an id without a row leaves an empty bag
        inp, rows=rows.index_select(0, idx), bags=inp.bags.index_select(0, idx), scale=scale,
        raw={},
    )  # fmt: skip


def map_raw_ids(step: StepContext, groups: Mapping[GroupKey, Group], training: bool) -> StepContext:
    """`step` with every group's dynamic slots mapped to rows (map_group); the same context
    when it has none."""
    if not any(inp.raw for inp in step.lookups.values()):
        return step
    lookups = {
        key: map_group(inp, groups[key], training) if inp.raw else inp
        for key, inp in step.lookups.items()
    }
    return step.replace(lookups=lookups)
