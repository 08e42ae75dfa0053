"""A dynamic table's counters (DynamicStats), summed over its shards and ranks by the trainer.

Each rank reports, per dynamic table, its shards' slots in use and slots ids may take (gauges
at the time of reading), ids admitted and evicted since the last reading and in all (one
column shard of a table counts: column shards run the same map), training steps, and ids
looked up without grad (evaluation) and how many of them had no row. Summed over ranks they
give the table's occupancy, admissions and evictions per step and unknown-at-eval rate
(hybridrec.train.console.dynamic_rates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridrec.sparse.dynamic.idmap import DynamicMap


@dataclass
class DynamicStats:
    """One dynamic table's counters on one rank (see the module doc)."""

    used: int = 0  # slots holding an id now
    capacity: int = 0  # slots ids may take (an unknown row per bucket is not one)
    admitted: int = 0  # since the last reading
    evicted: int = 0
    admitted_total: int = 0  # since the table began (carried by checkpoints)
    evicted_total: int = 0
    steps: int = 0  # training steps since the last reading (one shard's)
    eval_ids: int = 0  # ids looked up without grad since the last reading
    eval_unknown: int = 0  # ... of which had no row

    def add(self, other: DynamicStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def items(self) -> list[tuple[str, int]]:
        return list(dataclasses.asdict(self).items())

    @property
    def occupancy(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0

    @property
    def unknown_rate(self) -> float:
        return self.eval_unknown / self.eval_ids if self.eval_ids else 0.0


def dynamic_metrics(maps: Iterable[DynamicMap]) -> dict[str, DynamicStats]:
    """Table name -> its counters over the maps held here, taken (reset) by this call."""
    out: dict[str, DynamicStats] = {}
    for dmap in maps:
        c = dmap.take_counters()
        if not dmap.counts_table:
            continue
        used, capacity = dmap.occupancy()
        st = DynamicStats(
            used,
            capacity,
            c.admitted,
            c.evicted,
            dmap.admitted_total,
            dmap.evicted_total,
            0,
            c.eval_ids,
            c.eval_unknown,
        )
        if dmap.b0 == 0:  # steps: one shard's (every shard steps once per training step)
            st.steps = c.steps
        out.setdefault(dmap.table.name, DynamicStats()).add(st)
    return out
