"""Host-resident embedding groups behind a device cache of hot rows (sharding=host).

For tables larger than device memory: a group's rows and optimizer state live in host
memory (pinned on CUDA), the device caches the rows in use. The contract: a cache is a
cache. Lookups and training give the all-on-device group's results bit for bit (a row is
updated in one place only and leaves the cache only with its latest values and state);
the cache changes when rows move, never what they hold. Bad input is an error, not a wrong
result: too little host memory before allocating (HostMemoryError), a cache that cannot
hold one batch's distinct rows (CacheTooSmallError).

cache.py: HostCachedEmbedding. policy.py: LFU with ageing, eviction, warm start. copies.py:
the UVA-kernel and staged copy paths. prefetch.py: admission on a background thread.
memory.py: host memory checks and pinning. stats.py: counters. See docs/host-cache.md.
`prefetch(rows)` returns a Prefetched, which the lookup of those rows takes (by value).
"""

from hybridrec.sparse.host.cache import CacheTooSmallError, HostCachedEmbedding
from hybridrec.sparse.host.copies import HOST_COPY_MODES
from hybridrec.sparse.host.memory import HostMemoryError, check_host_memory
from hybridrec.sparse.host.prefetch import Admitted, Prefetched
from hybridrec.sparse.host.stats import CacheStats

__all__ = [
    "HOST_COPY_MODES",
    "Admitted",
    "CacheStats",
    "CacheTooSmallError",
    "HostCachedEmbedding",
    "HostMemoryError",
    "Prefetched",
    "check_host_memory",
]
