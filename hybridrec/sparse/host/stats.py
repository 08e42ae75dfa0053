"""A host cache's counters (CacheStats), summed over groups and read by the trainer's logs.

Rows are distinct rows per lookup: a row looked up twice in one batch counts once. Times are
seconds; `transfer_s` is wall time for staged copies and GPU time for kernel copies.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheStats:
    """Counters since the last `take_stats()`. Rows are distinct rows per lookup."""

    rows_requested: int = 0  # distinct rows those lookups needed
    hits: int = 0  # ... of which were already cached (or prefetched)
    rows_loaded: int = 0  # host -> device
    rows_written: int = 0  # device -> host (dirty evictions and flushes)
    bytes_moved: int = 0  # both directions, rows and their optimizer state
    transfer_s: float = 0.0  # time spent moving rows (on the caller or the prefetch thread)
    wait_s: float = 0.0  # time lookups spent waiting for host memory (admission + prefetch)

    def add(self, other: CacheStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
