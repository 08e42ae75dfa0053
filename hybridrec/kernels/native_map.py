"""The dynamic tables' id -> slot maps on the CPU, in C (native/dynamic_map.c via ctypes).

DynamicMap (hybridrec/sparse/dynamic/idmap.py) takes these where `usable()` (CPU tensors, the
native library loaded, not inside `native.disabled()`), else its torch path; both make the same
decisions bit for bit (tests/unit/test_native_map.py). The C side replaces the torch path's
~40 ops per step (unique, sorted-index searches, per-bucket sorts, topk) by one pass over the
ids and a hash-table index, `NativeIndex`, derived from the slots like the sorted one.

    uses(...)   one step's distinct ids, their counts and slots; hits recorded; the misses
    admit(...)  the ids the policy admits take slots (free first, then one eviction per bucket)
    find(...)   evaluation lookups
    fresh_rows(...)  admitted ids' initial rows (kernels/hashing.fresh_rows' values)
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from hybridrec.kernels import native

_I64, _P = ctypes.c_int64, ctypes.c_void_p
EVICT_KINDS = {"lfu": 0, "lru": 1, "ttl": 2}


class AdmitArgs(ctypes.Structure):
    """hr_dyn_admit's one argument: native/dynamic_map.c's hr_dyn_admit_args, field for field
    (pointers as data addresses; tests/unit/test_native_map_layout.py compares this layout
    with the C library's). `admit` says what each holds."""

    _fields_ = [
        # the step: the ids to admit [A], their entries of the step's distinct ids, counts
        ("want", _P),
        ("want_u", _P),
        ("want_count", _P),
        ("a", _I64),
        ("uslot", _P),  # the step's distinct ids' slots [U]
        ("u", _I64),
        # the shard's map, written in place
        ("slot_id", _P),
        ("score", _P),
        ("last", _P),
        ("admits", _P),
        ("evicts", _P),
        ("free_pos", _P),
        ("n_free", _P),
        ("busy", _P),
        ("h", _P),  # the index's entries [cap, 2]
        ("cap", _I64),
        # geometry and policy
        ("S", _I64),
        ("sw", _I64),
        ("nb", _I64),
        ("b0", _I64),
        ("buckets", _I64),
        ("evict", _I64),  # EVICT_KINDS
        ("t", _I64),
        ("ttl_steps", _I64),
        ("bulk", _I64),
        # out
        ("new_slot", _P),
        ("new_id", _P),
        ("left", _P),
        ("counts", _P),
    ]


_SIGNATURES = {
    "hr_dyn_index_build": ([_P, _I64, _P, _I64], None),
    "hr_dyn_find": ([_P, _I64, _P, _I64, _P], None),
    "hr_dyn_uses": ([_P, _I64, _P, _I64, _I64, _I64, *[_P] * 10], _I64),
    "hr_dyn_fresh_rows": ([_P, _I64, _I64, _I64, _I64, ctypes.c_float, _P], None),
    "hr_dyn_admit": ([ctypes.POINTER(AdmitArgs)], _I64),
    "hr_dyn_admit_layout": ([_P, _I64], _I64),
    "hr_dyn_admit_fields": ([], ctypes.c_char_p),
}


def _fn(name: str) -> ctypes._CFuncPtr:
    return native.function(name, _SIGNATURES[name])


def usable(t: torch.Tensor) -> bool:
    """True when the map's tensors (on t's device) can take the C path."""
    return t.device.type == "cpu" and native.lib() is not None


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class NativeIndex:
    """raw id -> slot of a shard's slot_id [R]: an open-addressing hash table of `cap` entries
    (a power of two > R; id and slot, 16 bytes each; the runtime's size is
    sparse.costs.index_entries), built from the slots (a function of them alone)."""

    def __init__(self, slot_id: torch.Tensor, cap: int) -> None:
        r = slot_id.numel()
        if cap & (cap - 1) or cap <= r:
            raise ValueError(f"an index of {r} slots needs a power of two > {r} entries, not {cap}")
        self.cap = cap
        self.entries = torch.empty(cap, 2, dtype=torch.int64)
        _fn("hr_dyn_index_build")(_ptr(self.entries), cap, _ptr(slot_id.contiguous()), r)

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """[N] each id's slot, -1 for none."""
        ids = ids.contiguous()
        out = torch.empty_like(ids)
        _fn("hr_dyn_find")(_ptr(self.entries), self.cap, _ptr(ids), ids.numel(), _ptr(out))
        return out


@dataclass(frozen=True)
class Uses:
    """hr_dyn_uses' result: the counts [U] and slots [U] (-1: missed) of the step's distinct
    ids (first-occurrence order), each id's entry [N]; the misses ascending [M] and their
    entries [M]."""

    counts: torch.Tensor
    slots: torch.Tensor
    inverse: torch.Tensor
    miss_ids: torch.Tensor
    miss_u: torch.Tensor


def uses(
    ids: torch.Tensor, index: NativeIndex, clock: int, lfu: bool, score: torch.Tensor,
    last: torch.Tensor, busy: torch.Tensor,
) -> Uses:  # fmt: skip
    """One step's ids [N]: dedupe, look up; each hit slot marked busy, last = clock, and under
    LFU its score += its count."""
    ids = ids.contiguous()
    n = ids.numel()
    uniq, counts, inverse, slots, miss_ids, miss_u = (
        torch.empty(n, dtype=torch.int64) for _ in range(6)
    )
    m = ctypes.c_int64(0)
    u = _fn("hr_dyn_uses")(
        _ptr(ids), n, _ptr(index.entries), index.cap, clock, int(lfu),
        _ptr(score), _ptr(last), _ptr(busy), _ptr(uniq), _ptr(counts), _ptr(inverse),
        _ptr(slots), _ptr(miss_ids), _ptr(miss_u), ctypes.addressof(m),
    )  # fmt: skip
    if u < 0:
        raise MemoryError(f"out of memory mapping {n} ids of a dynamic table")
    k = m.value
    return Uses(counts[:u], slots[:u], inverse, miss_ids[:k], miss_u[:k])


@dataclass(frozen=True)
class Admitted:
    """hr_dyn_admit's result: the slots given [K] and their ids [K] (in want order), which ids
    of `want` got none [A] bool, and the ids evicted (extra victims and slots' former ids)."""

    new_slots: torch.Tensor
    new_ids: torch.Tensor
    left: torch.Tensor
    evicted: int


def admit(
    want: torch.Tensor, want_u: torch.Tensor, want_counts: torch.Tensor, slots: torch.Tensor,
    state: dict[str, torch.Tensor], index: NativeIndex, geometry: tuple[int, ...], clock: int,
    evict: str, ttl_steps: int, bulk: int,
) -> Admitted:  # fmt: skip
    """The ids `want` [A] (ascending; their entries of the step's distinct ids `want_u`, this
    step's counts) take slots per the policy; `slots` [U] (the step's) gets theirs, and busy is
    cleared. state: slot_id, score, last, admits, evicts [R], free [nb, Sw], n_free [nb], busy
    [R], written in place; geometry: (S, Sw, nb, b0, buckets)."""
    want, want_u = want.contiguous(), want_u.contiguous()
    want_counts = want_counts.contiguous()
    a = want.numel()
    new_slots, new_ids = torch.empty(a, dtype=torch.int64), torch.empty(a, dtype=torch.int64)
    left = torch.zeros(a, dtype=torch.int8)
    counts = torch.zeros(2, dtype=torch.int64)
    s = state
    S, sw, nb, b0, buckets = geometry
    args = AdmitArgs(
        want=_ptr(want), want_u=_ptr(want_u), want_count=_ptr(want_counts), a=a,
        uslot=_ptr(slots), u=slots.numel(),
        slot_id=_ptr(s["slot_id"]), score=_ptr(s["score"]), last=_ptr(s["last"]),
        admits=_ptr(s["admits"]), evicts=_ptr(s["evicts"]), free_pos=_ptr(s["free"]),
        n_free=_ptr(s["n_free"]), busy=_ptr(s["busy"]), h=_ptr(index.entries), cap=index.cap,
        S=S, sw=sw, nb=nb, b0=b0, buckets=buckets, evict=EVICT_KINDS[evict], t=clock,
        ttl_steps=ttl_steps, bulk=bulk,
        new_slot=_ptr(new_slots), new_id=_ptr(new_ids), left=_ptr(left), counts=_ptr(counts),
    )  # fmt: skip
    k = _fn("hr_dyn_admit")(ctypes.byref(args))
    if k == -1:
        raise MemoryError(f"out of memory admitting {a} ids into a dynamic table")
    if k == -2:
        raise ValueError("a dynamic table shard was given ids of buckets it does not own")
    return Admitted(new_slots[:k], new_ids[:k], left.bool(), int(counts[1]))


def admit_layout() -> tuple[list[str], list[int]]:
    """The C library's hr_dyn_admit_args: (its field names, [sizeof, each field's offset])."""
    names = _fn("hr_dyn_admit_fields")().decode().split()
    out = torch.zeros(len(names) + 1, dtype=torch.int64)
    n = _fn("hr_dyn_admit_layout")(_ptr(out), out.numel())
    assert n == out.numel(), f"hr_dyn_admit_layout gives {n} values for {len(names)} fields"
    return names, out.tolist()


def fresh_rows(
    ids: torch.Tensor, key: int, col_start: int, col_end: int, bound: float
) -> torch.Tensor:
    """[K, col_end - col_start] fp32: hashing.fresh_rows' values for ids [K] (table key `key`,
    values uniform in [-bound, bound]), bit for bit."""
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), col_end - col_start, dtype=torch.float32)
    _fn("hr_dyn_fresh_rows")(_ptr(ids), ids.numel(), key, col_start, col_end, bound, _ptr(out))
    return out
