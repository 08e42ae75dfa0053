"""Row copies between pinned host memory and the device cache, by a GPU kernel (UVA).

`copy_rows(src, src_rows, dst, dst_rows)`: dst[dst_rows[i]] = src[src_rows[i]] for every i,
one Triton program per block of rows. With CUDA's unified addressing a pinned host tensor is
readable and writable from a kernel, so a cache fill is one kernel reading the rows straight
over PCIe (sorted rows read best: 66M rows/s on the H100 vs 28.6M random, DESIGN.md) and a
write-back one kernel writing them: no CPU gather, no staging buffer, no copy of the row ids
to the host. The alternative (`host.HostCachedEmbedding`'s staged path) gathers on the CPU
into a pinned buffer and copies it; `sharding.host_copy` chooses (auto: the kernel when it
works on this machine, checked once by `kernel_works`).

Like the other kernels (hybridrec.sparse.triton_ops) it is jitted on first use per mode, uses
builtins only, and runs in Triton's CPU interpreter (TRITON_INTERPRET=1) for tests.

Legend: M = rows copied, D = width (a 1-D state tensor is treated as [R, 1]).
"""

from __future__ import annotations

import torch

from hybridrec.sparse.triton_ops import _interpreting, tl, triton

BLOCK_ROWS = 16


def _copy_kernel(
    src, src_rows, dst, dst_rows, n, width, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):  # noqa: ANN001, E501, N803
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < n
    s = tl.load(src_rows + r, mask=row_ok, other=0)
    d = tl.load(dst_rows + r, mask=row_ok, other=0)
    for c0 in range(0, width, BLOCK_D):
        c = c0 + tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (c < width)[None, :]
        vals = tl.load(src + s[:, None] * width + c[None, :], mask=ok, other=0)
        tl.store(dst + d[:, None] * width + c[None, :], vals, mask=ok)


_JITTED: dict[bool, object] = {}


def _kernel():  # noqa: ANN202
    mode = _interpreting()
    if mode not in _JITTED:
        _JITTED[mode] = triton.jit(_copy_kernel)
    return _JITTED[mode]


def copy_rows(
    src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor
) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] (src, dst [R, D] or [R], same dtype, contiguous;
    index tensors [M] int64 on the device that runs the kernel; dst rows distinct)."""
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
    _kernel()[grid](src, src_rows, dst, dst_rows, n, width, BLOCK_R=BLOCK_ROWS, BLOCK_D=block_d)


_WORKS: dict[int, bool] = {}


def kernel_works(device: torch.device) -> bool:
    """Whether a kernel on `device` can read and write pinned host memory here (tried once:
    pinned rows to the device and back, compared)."""
    if triton is None or device.type != "cuda":
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _WORKS:
        try:
            host = torch.arange(64, dtype=torch.float32).reshape(16, 4).pin_memory()
            dev = torch.zeros(16, 4, device=device)
            idx = torch.arange(16, device=device).flip(0)
            copy_rows(host, idx, dev, torch.arange(16, device=device))
            back = torch.zeros(16, 4).pin_memory()
            copy_rows(dev, torch.arange(16, device=device), back, idx)
            torch.cuda.synchronize(device)
            _WORKS[key] = torch.equal(back, host) and torch.equal(dev.cpu(), host.flip(0))
        except Exception:  # the launcher refused the host pointer, or the copy was wrong
            _WORKS[key] = False
    return _WORKS[key]
