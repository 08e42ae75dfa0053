"""Dynamic embedding tables: raw ids from an open set mapped to a fixed number of rows.

hybridrec.kernels.hashing (buckets, draws, fresh rows) and kernels.probe (the map's search)
serve this package and inference alike; here: policy.py (admission, candidates, slot choice),
idmap.py (DynamicMap: one shard's map and policy state), remap.py (raw ids -> rows between
the input dist and the lookup), stats.py (DynamicStats), check.py (a saved map's invariants,
checked before a load uses it). docs/dynamic.md explains the design.
"""

from hybridrec.sparse.dynamic.idmap import DynamicCounters, DynamicMap

__all__ = ["DynamicCounters", "DynamicMap"]
