"""A dynamic table's id -> slot probe: binary search of raw ids in a shard's sorted keys.

`probe(keys, slots, ids)` is what the map calls (hybridrec.sparse.dynamic.idmap.find): the
Triton kernel where it runs (`available`: CUDA, or the interpreter in tests), else torch's
searchsorted (`probe_torch`). Both return, for each id, the slot stored with the equal key,
-1 where no key equals it: bit-identical results (integers only).

The kernel: one program per BLOCK ids, each a branch-free lower-bound search of a fixed number
of halvings (ceil(log2(K + 1)), a compile-time constant per size class) over keys [K] int64
ascending and distinct, then one compare. Inserts are the map's (a sort of the occupied ids
when a step admits: it changes at most once per step).

Legend: N ids, K keys.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridrec.kernels import _common
from hybridrec.kernels._common import _check_device, _opts, _require, tl, triton
from hybridrec.kernels.dispatch import available

BLOCK = 256


def _probe_kernel(
    keys_ptr, slots_ptr, ids_ptr, out_ptr, N, K, STEPS: tl.constexpr, BLOCK: tl.constexpr
):
    """out[i] = slots[j] where keys[j] == ids[i], else -1 (keys ascending, distinct)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(ids_ptr + offs, mask=mask, other=0)
    lo = tl.full([BLOCK], 0, tl.int64)
    hi = tl.full([BLOCK], 0, tl.int64) + K
    for _ in range(STEPS):  # lower bound: the first key >= x
        active = lo < hi
        mid = (lo + hi) // 2
        k = tl.load(keys_ptr + mid, mask=mask & active, other=0)
        right = active & (k < x)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & (k >= x), mid, hi)
    pos = tl.minimum(lo, K - 1)
    k = tl.load(keys_ptr + pos, mask=mask, other=0)
    s = tl.load(slots_ptr + pos, mask=mask, other=-1)
    tl.store(out_ptr + offs, tl.where(k == x, s, -1), mask=mask)


def probe_kernel(keys: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[N] int64: the Triton probe (see the module doc). keys [K] ascending distinct, slots
    [K], ids [N]: int64, contiguous, on one device."""
    for name, t in (("keys", keys), ("slots", slots), ("ids", ids)):
        _require(t.dtype == torch.int64 and t.dim() == 1, f"{name} must be [n] int64")
    _require(keys.numel() == slots.numel(), "keys and slots must have one entry each")
    _check_device(ids, keys=keys, slots=slots)
    out = torch.full_like(ids, -1)
    n, k = ids.numel(), keys.numel()
    if n == 0 or k == 0:
        return out
    steps = k.bit_length()  # halvings until lo == hi: the range [0, K] has K + 1 ends
    grid = (triton.cdiv(n, BLOCK),)
    _common.jitted(_probe_kernel)[grid](
        keys.contiguous(), slots.contiguous(), ids.contiguous(), out, n, k,
        STEPS=steps, BLOCK=BLOCK, **_opts(BLOCK),
    )  # fmt: skip
    return out


def probe_torch(keys: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """probe_kernel's result with torch ops (numpy's search on the CPU: twice torch's)."""
    k = keys.numel()
    if k == 0 or ids.numel() == 0:
        return torch.full_like(ids, -1)
    if ids.device.type == "cpu":
        pos = torch.from_numpy(np.searchsorted(keys.numpy(), ids.numpy()))
    else:
        pos = torch.searchsorted(keys, ids)
    pos = pos.clamp_(max=k - 1)
    found = keys.index_select(0, pos) == ids
    return torch.where(found, slots.index_select(0, pos), -1)


def probe(keys: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[N]: the slot of each id (-1: none); the kernel where it runs, else torch."""
    if available(ids) and keys.numel() and ids.numel():
        return probe_kernel(keys, slots, ids)
    return probe_torch(keys, slots, ids)
