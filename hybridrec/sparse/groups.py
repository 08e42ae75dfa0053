"""A rank's fused groups, typed: each group's key, its rows and the maps of its dynamic tables.

The layout (hybridrec.sparse.layout) fuses a rank's units into one group per `GroupKey`
(placement and width). A `Group` holds what serves that key: `store`, one weight with its
optimizer state (FusedEmbedding, or HostCachedEmbedding: host memory behind a device cache),
and `maps`, the DynamicMap of each dynamic table's shard among its slots (by slot position),
which turns that slot's raw ids into its rows before the lookup
(hybridrec.sparse.dynamic.remap). Nothing about a group is encoded in a string.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridrec.sparse.dynamic.idmap import DynamicMap
from hybridrec.sparse.fused import FusedEmbedding, RowOptimizer
from hybridrec.sparse.host import HostCachedEmbedding
from hybridrec.sparse.layout import GroupKey, ShardedLayout
from hybridrec.types import CACHE_HALFLIFE


@dataclass(frozen=True)
class HostOptions:
    """How host-resident groups keep their rows (sharding.pin_host, host_copy, cache_halflife)."""

    pin: bool = True
    copy: str = "auto"
    halflife: int = CACHE_HALFLIFE


class Group(nn.Module):
    """One fused group of one rank: `key`, its rows `store`, and per dynamic slot its map.
    `slot_rows[p]`: where slot p's rows start in `store` (and, last, its row count)."""

    def __init__(
        self,
        key: GroupKey,
        store: FusedEmbedding,
        maps: dict[int, DynamicMap],
        slot_rows: list[int],
    ) -> None:
        super().__init__()
        self.key = key
        self.store = store
        self.map_slots = tuple(maps)
        self.maps = nn.ModuleList(maps.values())
        self.slot_rows = list(slot_rows)

    def dynamic(self) -> list[tuple[int, DynamicMap]]:
        """(slot position, its map) of every dynamic slot, in slot order."""
        return list(zip(self.map_slots, self.maps, strict=True))

    def map_at(self, pos: int) -> DynamicMap | None:
        """The map of slot `pos` (None: a fixed table's shard)."""
        return dict(self.dynamic()).get(pos)

    @property
    def host(self) -> HostCachedEmbedding | None:
        """The store when it is host-resident behind a device cache."""
        return self.store if isinstance(self.store, HostCachedEmbedding) else None


def build_groups(
    layout: ShardedLayout,
    optimizer: RowOptimizer | None,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    host: HostOptions,
) -> list[Group]:
    """This rank's groups, in the layout's group order (its units' groups, then the
    replicated tables' by width)."""
    out = []
    for key, slots in layout.group_slots.items():
        shards = [(layout.storage[i], i, shard) for i, shard in slots]
        inputs = layout.input_slots(key)
        if key.on_host:
            store: FusedEmbedding = HostCachedEmbedding(
                shards,
                optimizer,
                sum(shard.cache_rows for _, shard in slots),
                seed,
                device,
                dtype,
                host.pin,
                age_every=host.halflife,
                copy=host.copy,
                input_slots=inputs,
            )
        else:
            store = FusedEmbedding(shards, optimizer, seed, device, dtype, inputs)
        maps = {
            pos: DynamicMap(layout.storage[i], i, shard, seed, device)
            for pos, (i, shard) in enumerate(slots)
            if layout.storage[i].dynamic is not None
        }
        out.append(Group(key, store, maps, layout.slot_rows(key)))
    return out
