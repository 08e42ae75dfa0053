"""Host memory for host-resident tables: the up-front check and (pinned) allocation.

`check_host_memory` refuses, before anything is allocated, tables that exceed the budget
(`sharding.host_gb`, else what the OS reports free). `_empty_host` allocates host tensors,
pinned when asked (tables and their state pinned by registration at exactly their size;
per-step staging buffers from torch's caching pinned allocator); a failed allocation is a
HostMemoryError naming what it was for and its size, never a bare RuntimeError.
"""

from __future__ import annotations

import os

import torch

from hybridrec.kernels import host_copy

GIB = 1 << 30


class HostMemoryError(RuntimeError):
    """Host-resident tables that do not fit in (or cannot be pinned in) host memory."""


def available_host_bytes() -> int:
    """Host memory the OS reports free for new allocations (MemAvailable), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(need: int, budget: int | None, what: str) -> None:
    """Raise HostMemoryError, before allocating, when `need` bytes exceed the budget
    (`sharding.host_gb`, else what the OS reports free)."""
    if budget is None:
        budget, source = available_host_bytes(), "free host memory (MemAvailable)"
    else:
        source = "sharding.host_gb"
    if need > budget:
        raise HostMemoryError(
            f"{what} need {need / GIB:.2f} GiB ({need:,} bytes) of host memory, but "
            f"{source} is {budget / GIB:.2f} GiB ({budget:,} bytes); use more ranks, "
            "fewer or smaller tables, or fp16/bf16 tables (model.table_dtype)"
        )


def _empty_host(
    shape: tuple[int, ...], dtype: torch.dtype, pin: bool, what: str, exact: bool = False
) -> torch.Tensor:
    """Host memory for `what`, pinned when `pin`. `exact`: tables and their state, pinned
    by registration at exactly their size (host_copy.pinned_empty; torch's pinned allocator
    would round them up to a power of two); otherwise torch's caching pinned allocator,
    which recycles the per-step staging buffers."""
    try:
        if pin and exact:
            return host_copy.pinned_empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, pin_memory=pin)
    except (RuntimeError, MemoryError) as e:
        size = dtype.itemsize
        for n in shape:
            size *= n
        raise HostMemoryError(
            f"could not allocate {size / GIB:.2f} GiB of {'pinned ' if pin else ''}host memory "
            f"for {what}: {e}. Set sharding.pin_host=false (pageable memory, slower copies) or "
            "lower the tables' size"
        ) from None
