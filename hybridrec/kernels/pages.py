"""Transparent huge pages for large CPU tensors read and written at random rows.

Embedding tables and their optimizer state are touched a row here, a row there: with 4 KiB
pages nearly every row costs a TLB miss and a page-table walk. `huge_pages(t)` asks Linux
(madvise MADV_HUGEPAGE) to back the tensor with 2 MiB pages where transparent huge pages are
enabled ("madvise" or "always" in /sys/kernel/mm/transparent_hugepage/enabled). It must be
called before the memory is first written: the pages are chosen when they fault in.
Elsewhere (another OS, THP "never", a tensor under 4 MiB) it does nothing. The measured gain
is in benchmarks/results/huge_pages_cpu.md (`python -m benchmarks.huge_pages`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

MADV_HUGEPAGE = 14  # Linux
HUGE = 2 << 20
_libc: list[ctypes.CDLL | None] = []


def _madvise() -> ctypes.CDLL | None:
    if not _libc:
        lib = None
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            except (OSError, AttributeError):
                lib = None
        _libc.append(lib)
    return _libc[0]


def huge_pages(t: torch.Tensor) -> bool:
    """Advise huge pages for the 2 MiB-aligned part of CPU tensor t's memory; True when the
    kernel accepted the advice (it may still use small pages when none are free)."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < 2 * HUGE:
        return False
    lib = _madvise()
    if lib is None:
        return False
    start = (t.data_ptr() + HUGE - 1) // HUGE * HUGE
    end = (t.data_ptr() + nbytes) // HUGE * HUGE
    return end > start and lib.madvise(start, end - start, MADV_HUGEPAGE) == 0
