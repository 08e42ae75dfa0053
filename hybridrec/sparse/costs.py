"""The byte sizes the sharded runtime commits to, and its replica-sync rule.

The runtime (`hybridrec.sparse.sharded`, `hybridrec.sparse.host`) allocates and sends exactly
these sizes; the planner's memory and cost models (`hybridrec.planner`) import them, so the
model equals what is measured. Plain numbers only: no tensors, no process group.

- ids: int64 in memory (`ID_BYTES`); across the input dist int32 when every table fits
  (`id_wire_bytes`);
- pooled embeddings and their gradients: fp32 (`EMB_BYTES`);
- host-resident tables: per cache row its table row and a dirty flag (`CACHE_META_BYTES`),
  per table row its cache slot and use count (`SLOT_BYTES`);
- ids sent with a count per sample, which makes the sizes travel first (`counted`);
- replicated tables' row gradients: all-reduced or all-gathered, the cheaper (`replica_sync`);
- a dynamic shard's id -> slot map (`dynamic_map_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridrec.types import ModeTraits, TableConfig

ID_BYTES = 8  # ids in memory, and row ids in the replicated tables' gradient sync: int64
INT32_IDS = 2**31 - 1  # tables up to this many rows send ids through the input dist as int32
EMB_BYTES = 4  # pooled embeddings and their gradients travel as fp32
CACHE_META_BYTES = 9  # per cache row: its table row (int64) and a dirty flag
SLOT_BYTES = 8  # per host-resident row: its cache slot (int32) and its use count (fp32)
# per slot of a dynamic shard's map (hybridrec.sparse.dynamic.idmap): its id, LFU score (fp32),
# last use, admission and eviction totals, and a packed candidate's id and count
DYNAMIC_SLOT_BYTES = 8 + 4 + 8 + 8 + 8 + 8 + 8
INDEX_ENTRY_BYTES = 16  # an entry of the map's lookup index: an id and its slot


def index_entries(rows: int) -> int:
    """Entries of a dynamic shard's hash index (kernels/native_map.NativeIndex): the least
    power of two, at least 16, holding 1.5 x its rows."""
    cap = 16
    while cap < rows + rows // 2:
        cap *= 2
    return cap


def dynamic_map_bytes(rows: int) -> int:
    """Bytes of a dynamic shard's map of `rows` slots: its per-slot arrays, its hash index and
    the step's one-byte marks (the C path's; a GPU's sorted index takes less: 16 per slot)."""
    return rows * (DYNAMIC_SLOT_BYTES + 1) + index_entries(rows) * INDEX_ENTRY_BYTES


def id_wire_bytes(tables: Sequence[TableConfig]) -> int:
    """Bytes per id (and per length) in the input dist: 4 (int32, half of int64, exact)
    when every table's ids fit int32, else 8 (a dynamic table's ids are raw int64)."""
    return 4 if all(t.num_rows <= INT32_IDS and t.dynamic is None for t in tables) else 8


def counted(traits: ModeTraits, jagged: bool) -> bool:
    """Whether a feature's ids cross the input dist with one count per sample (then a small
    all-to-all of the payload sizes goes first): a unit of a row range (its share of a bag's
    ids varies) or of a jagged feature (its bags' lengths vary); never a replica, whose ids
    stay on their rank. The layout's `Unit.counted` for a mode's traits."""
    return not traits.replicated and (traits.partial_sums or jagged)


def replica_sync(rows: int, width: int, ids_per_rank: int, world: int) -> tuple[str, float]:
    """How a replicated table's row gradients are synced, and the bytes each rank sends.

    - "all_reduce": one [rows, width + 1] fp32 buffer (summed gradients plus a "touched"
      count), ring all-reduce: 2 (W-1)/W x rows x (width + 1) x 4 bytes. Best for tiny tables.
    - "all_gather": each rank's touched rows (at most min(rows, ids_per_rank)) with their
      gradients, padded to the largest rank's count: (W-1) x U x (width x 4 + 8) bytes. Best
      when a step touches few of a large table's rows.
    Every rank makes the same choice from the same numbers, and the planner counts these bytes.
    """
    reduce_bytes = 2 * (world - 1) / world * rows * (width + 1) * EMB_BYTES
    gather_bytes = (world - 1) * min(rows, ids_per_rank) * (width * EMB_BYTES + ID_BYTES)
    if gather_bytes <= reduce_bytes:  # on one rank both are 0: gathering skips a dense buffer
        return "all_gather", gather_bytes
    return "all_reduce", reduce_bytes
