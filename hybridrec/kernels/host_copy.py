"""Row copies between pinned host memory and the device cache, by a GPU kernel (UVA).

`copy_rows(src, src_rows, dst, dst_rows)`: dst[dst_rows[i]] = src[src_rows[i]] for every i,
one Triton program per block of rows. With CUDA's unified addressing a pinned host tensor is
readable and writable from a kernel, so a cache fill is one kernel reading the rows straight
over PCIe (sorted rows read faster than random ones) and a write-back one kernel writing
them: no CPU gather, no staging buffer, no copy of the row ids to the host. The alternative
(the host cache's staged path) gathers on the CPU into a pinned buffer and copies it;
`sharding.host_copy` chooses (auto: the kernel when it works on this machine, checked once by
`kernel_works`). `pinned_empty` makes host tables the kernel can use.

Like the other kernels it is jitted on first use per mode, uses builtins only, and runs in
Triton's CPU interpreter (TRITON_INTERPRET=1) for tests.

Legend: M = rows copied, D = width (a 1-D state tensor is treated as [R, 1]).
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch

from hybridrec.kernels import _common

# _interpreting: the host cache asks whether kernels run interpreted (on CPU tensors)
from hybridrec.kernels._common import _interpreting, tl, triton  # noqa: F401

BLOCK_ROWS = 16
_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped (kernels address it)
_ALIGN = 4096


class PinError(RuntimeError):
    """CUDA refused to pin (page-lock) a host buffer."""


def _cuda_register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_FLAGS))


def _cuda_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - teardown: the memory is freed next either way
        pass


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor of exactly `shape`, pinned with cudaHostRegister.

    Why not torch.empty(pin_memory=True): torch's caching host allocator rounds every pinned
    allocation up to a power of two, so the 1TB model's host group (188M rows x 128 fp32,
    96 GB) would ask for 128 GiB of a 125 GB machine. Here the buffer is a page-aligned
    numpy allocation registered (portable and mapped: the copy kernel addresses it through
    UVA); it is unregistered just before numpy frees it, when the last view of it is gone."""
    nbytes = math.prod(shape) * dtype.itemsize
    base = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = -base.ctypes.data % _ALIGN
    ptr = base.ctypes.data + start
    if nbytes:
        err = _cuda_register(ptr, nbytes)
        if err != 0:
            raise PinError(f"cudaHostRegister of {nbytes:,} bytes failed with cudaError {err}")
        fin = weakref.finalize(base, _cuda_unregister, ptr)
        fin.atexit = False  # at exit the process's memory goes anyway
    flat = torch.from_numpy(base[start : start + nbytes])  # holds `base` alive
    return flat.view(dtype).view(shape)


def _copy_kernel(
    src, src_rows, dst, dst_rows, n, width, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):  # noqa: ANN001, E501, N803
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.load(dst_rows + r, mask=r < n, other=-1)
    row_ok = d >= 0  # a negative destination row: skip the entry
    s = tl.load(src_rows + r, mask=row_ok, other=0)
    for c0 in range(0, width, BLOCK_D):
        c = c0 + tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (c < width)[None, :]
        vals = tl.load(src + s[:, None] * width + c[None, :], mask=ok, other=0)
        tl.store(dst + d[:, None] * width + c[None, :], vals, mask=ok)


def copy_rows(
    src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor
) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] (src, dst [R, D] or [R], same dtype, contiguous;
    index tensors [M] int64 on the device that runs the kernel; dst rows distinct). Entries
    with dst_rows[i] < 0 are skipped: a list can be written back in part without compacting
    it first (which would wait for the device)."""
    if triton is None:
        raise RuntimeError("copy_rows needs triton")
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"copy_rows: src {src.dtype} {list(src.shape)} and dst {dst.dtype} "
            f"{list(dst.shape)} must share dtype and row shape"
        )
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_rows: src and dst must be contiguous")
    if src_rows.shape != dst_rows.shape or src_rows.dim() != 1:
        raise ValueError(
            f"copy_rows: index tensors must be [M], got {list(src_rows.shape)} and "
            f"{list(dst_rows.shape)}"
        )
    n = src_rows.numel()
    if n == 0:
        return
    width = 1 if src.dim() == 1 else src[0].numel()
    block_d = min(128, triton.next_power_of_2(width))
    grid = (triton.cdiv(n, BLOCK_ROWS),)
    _common.jitted(_copy_kernel)[grid](
        src, src_rows, dst, dst_rows, n, width, BLOCK_R=BLOCK_ROWS, BLOCK_D=block_d
    )


_WORKS: dict[int, bool] = {}


def kernel_works(device: torch.device) -> bool:
    """Whether a kernel on `device` can read and write pinned host memory here (tried once:
    pinned rows to the device and back, compared)."""
    if triton is None or device.type != "cuda":
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _WORKS:
        try:
            host = pinned_empty((16, 4), torch.float32)  # the kind of memory tables use
            host.copy_(torch.arange(64, dtype=torch.float32).reshape(16, 4))
            dev = torch.zeros(16, 4, device=device)
            idx = torch.arange(16, device=device).flip(0)
            copy_rows(host, idx, dev, torch.arange(16, device=device))
            back = pinned_empty((16, 4), torch.float32).zero_()
            copy_rows(dev, torch.arange(16, device=device), back, idx)
            torch.cuda.synchronize(device)
            _WORKS[key] = torch.equal(back, host) and torch.equal(dev.cpu(), host.flip(0))
        except Exception:  # the launcher refused the host pointer, or the copy was wrong
            _WORKS[key] = False
    return _WORKS[key]
