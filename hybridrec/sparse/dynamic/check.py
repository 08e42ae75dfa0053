"""A dynamic map's saved arrays checked against the map's invariants before a load uses them.

What a checkpoint (or an export) holds of a map is its per-row arrays (DynamicMap.views); the
free lists and the lookup index are rebuilt from `dyn_slot_id`, trusting it. A map that breaks
an invariant the map keeps while training would load and train silently wrong: an id in a row
of another bucket is never found again (its bucket's search never looks there), an id in two
rows trains two rows, an id in a bucket's unknown row shares it with every unknown id, a
rounded id loses its row. `map_problem` states the invariants once and names the first one
broken; hybridrec.train.checkpoint (load, warm start) calls it on every saved map.

Per row r of a table of R rows in `buckets` buckets of S = R / buckets rows (bucket of row r:
r // S), for rows [row_start, row_start + n) (whole buckets):

    dyn_slot_id    int64   -1 (free), or a raw id in [0, RAW_ID_MAX] whose hash bucket
                           (hashing.bucket_of) is the row's, held by no other row and, under
                           unknown="row", not in its bucket's last row (the unknown row)
    dyn_cand_id    int64   -1 (none), or a count-policy candidate: an id as above (its row's
                           bucket, once), with
    dyn_cand_count int64   its count >= 1; 0 where dyn_cand_id is -1
    dyn_score      float32 finite, >= 0 (LFU use counts)
    dyn_last, dyn_admits, dyn_evicts   int64 >= 0 (a step, totals)

Every array is 1-D with one value per row, in the dtype above (a float copy of an id array
has rounded its ids: refused, never cast back).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hybridrec.kernels.hashing import bucket_of
from hybridrec.sparse.ids import RAW_ID_MAX
from hybridrec.types import Dynamic

# a map's saved arrays (DynamicMap.views) and their dtypes
MAP_DTYPES = {
    "dyn_slot_id": torch.int64,
    "dyn_score": torch.float32,
    "dyn_last": torch.int64,
    "dyn_admits": torch.int64,
    "dyn_evicts": torch.int64,
    "dyn_cand_id": torch.int64,
    "dyn_cand_count": torch.int64,
}


def _first(mask: torch.Tensor) -> int | None:
    """The first True position of a 1-D bool tensor, None when none is."""
    hit = mask.nonzero()
    return int(hit[0, 0]) if hit.numel() else None


def map_problem(
    arrays: Mapping[str, torch.Tensor], policy: Dynamic, table_rows: int, row_start: int, n: int
) -> str | None:
    """What is wrong with the map arrays of rows [row_start, row_start + n) of a dynamic table
    of `table_rows` rows under `policy` (module doc), in words naming the array, row and id;
    None when nothing is. Reads every array once; changes nothing."""
    for name, dtype in MAP_DTYPES.items():
        a = arrays.get(name)
        if a is None:
            return f"it has no map array {name}"
        problem = _array_problem(name, a, dtype, n)
        if problem:
            return problem
    problem = slot_id_problem(arrays["dyn_slot_id"], policy, table_rows, row_start, n)
    if problem:
        return problem
    S = table_rows // policy.buckets
    rows = torch.arange(row_start, row_start + n)
    cand, count = arrays["dyn_cand_id"], arrays["dyn_cand_count"]
    problem = _ids_problem("dyn_cand_id", cand, rows, S, policy)
    if problem:
        return problem
    r = _first(((cand >= 0) & (count < 1)) | ((cand < 0) & (count != 0)))
    if r is not None:
        what = f"candidate id {int(cand[r])}" if cand[r] >= 0 else "no candidate"
        return f"row {row_start + r} has {what} with dyn_cand_count {int(count[r])}"
    score = arrays["dyn_score"]
    r = _first(~torch.isfinite(score) | (score < 0))
    if r is not None:
        return f"row {row_start + r}'s dyn_score is {float(score[r])} (a use count: >= 0)"
    for name in ("dyn_last", "dyn_admits", "dyn_evicts"):
        r = _first(arrays[name] < 0)
        if r is not None:
            return f"row {row_start + r}'s {name} is {int(arrays[name][r])} (>= 0)"
    return None


def slot_id_problem(
    slot_id: torch.Tensor,
    policy: Dynamic,
    table_rows: int,
    row_start: int,
    n: int,
    name: str = "dyn_slot_id",
) -> str | None:
    """What is wrong with the slot ids [n] of rows [row_start, row_start + n) of a dynamic
    table (module doc: int64, 1-D, whole buckets, ids in range, in their rows' buckets, once
    each, none in an unknown row), None when nothing is; `name`: the array's, in the words.
    An export's `slot_id` is checked with this alone (it carries no other map array)."""
    problem = _array_problem(name, slot_id, torch.int64, n)
    if problem:
        return problem
    S = table_rows // policy.buckets
    if row_start % S or n % S:
        return (
            f"rows {row_start}:{row_start + n} do not fall on its buckets of {S} rows "
            f"(buckets={policy.buckets})"
        )
    rows = torch.arange(row_start, row_start + n)
    problem = _ids_problem(name, slot_id, rows, S, policy)
    if problem or not policy.reserved_rows:
        return problem
    r = _first((rows % S == S - 1) & (slot_id >= 0))
    if r is not None:
        return (
            f"row {row_start + r}, bucket {(row_start + r) // S}'s unknown row "
            f"(unknown='row'), holds id {int(slot_id[r])} (a map trained with unknown='zeros' "
            "gives that row to an id)"
        )
    return None


def _array_problem(name: str, a: torch.Tensor, dtype: torch.dtype, n: int) -> str | None:
    if not isinstance(a, torch.Tensor):
        return f"{name} is a {type(a).__name__}, not a tensor"
    if a.dtype != dtype:
        why = " (a float copy has rounded its values)" if a.is_floating_point() else ""
        return f"{name} is {_name(a.dtype)}, not {_name(dtype)}{why}"
    if a.dim() != 1 or a.shape[0] != n:
        return f"{name} has shape {list(a.shape)}, not [{n}] (one value per row)"
    return None


def _ids_problem(
    name: str, ids: torch.Tensor, rows: torch.Tensor, S: int, policy: Dynamic
) -> str | None:
    """An id array's range, buckets and duplicates (module doc); rows [n]: the table rows."""
    r = _first((ids < -1) | (ids > RAW_ID_MAX))
    if r is not None:
        return (
            f"row {int(rows[r])}'s {name} is {int(ids[r])} (a raw id is in 0..{RAW_ID_MAX}, "
            "-1 for none)"
        )
    held = ids >= 0
    own = bucket_of(ids.clamp(min=0), policy.buckets)
    r = _first(held & (own != rows // S))
    if r is not None:
        return (
            f"row {int(rows[r])} ({name}) holds id {int(ids[r])}, whose bucket is "
            f"{int(own[r])} of {policy.buckets}, not the row's bucket {int(rows[r]) // S} (a "
            "map of other buckets, or moved ids)"
        )
    at = held.nonzero().squeeze(1)
    values, order = torch.sort(ids.index_select(0, at))
    same = _first(values[1:] == values[:-1])
    if same is not None:
        a, b = sorted(int(rows[at[order[i]]]) for i in (same, same + 1))
        return f"id {int(values[same])} is in rows {a} and {b} of {name} (an id has one row)"
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
