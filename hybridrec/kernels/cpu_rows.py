"""The torch (CPU) path of the sparse backward: gradient dedupe and the rows' write-back.

`dedupe_sorted(rows, bags, scale, grad_pooled)` -> (unique rows [U] ascending, grads [U, D]
fp32), each row's gradient the sum of grad_pooled[bags[i]] * scale[i] over its ids i in id
order. One stable sort of the rows gives the segments; a CSR matrix [U, B] (row u's ids in id
order, values 1) times grad_pooled sums each segment without building the [N, D] per-id
gradients. With a pooling scale the per-id products are formed first (as the reference does)
and a CSR matrix over positions sums them, so the rounding is the reference's either way.
`dedupe_reference` is the former path (sorted torch.unique + index_add_): same sums, same
order, bit for bit; tests and benchmarks.sparse_update compare the two.

`gather_rows(src, rows)` and `copy_rows(dst, rows, src)`: src[rows], and dst[rows] = src for
unique rows, moved as 16-byte words when the row layout allows (index ops cost per element).
`apply_delta`: weight[rows] -= scale * delta, fp32 math (the add kernel's rounding, as
index_add_ with alpha), rounded once.

Legend: N = ids, B = bags, D = width, U = distinct rows.
"""

from __future__ import annotations

import warnings

import torch

from hybridrec.kernels._common import round_to

_WORD = torch.complex128  # 16 bytes: a pure data-movement view, never computed with
_INT32_MAX = 2**31 - 1
SORTED_MIN_IDS = 4096  # fewer ids: dedupe_reference (same sums) costs less than the CSR setup
# the CSR matrix is internal to one call, never handed out: its beta notice tells users nothing
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


def _segments(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unique rows [U] ascending, crow [U + 1] segment offsets, perm [N]) of a stable sort."""
    keys = rows
    if int(rows.max()) <= _INT32_MAX and int(rows.min()) >= 0:
        keys = rows.to(torch.int32)  # the same stable order, a cheaper sort
    sorted_keys, perm = torch.sort(keys, stable=True)
    unique_keys, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    crow = counts.new_zeros(counts.numel() + 1)
    torch.cumsum(counts, 0, out=crow[1:])
    return unique_keys.to(torch.int64), crow, perm


def _csr_sum(crow: torch.Tensor, cols: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """[U, D]: row u = sum of dense[cols[j]] for j in crow[u]:crow[u + 1], in j order."""
    ones = torch.ones(cols.numel(), dtype=dense.dtype)
    size = (crow.numel() - 1, dense.shape[0])
    a = torch.sparse_csr_tensor(crow, cols, ones, size=size, check_invariants=False)
    # beta=0 into an uninitialised out: the result is written once (a @ dense zero-fills a
    # temporary and copies it out), and out's prior contents are never read
    out = torch.empty(size[0], dense.shape[1], dtype=dense.dtype)
    return torch.addmm(out, a, dense, beta=0, out=out)


def dedupe_sorted(
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | float | None,
    grad_pooled: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows [U] ascending, grads [U, D] fp32): per-id gradients grad_pooled[bags[i]] *
    scale[i] summed per distinct row in id order. rows, bags [N] int64; scale [N], a float or
    None. Deterministic, equal bit for bit to `dedupe_reference` (which other devices and
    calls of fewer than SORTED_MIN_IDS ids take)."""
    n = rows.numel()
    if n < max(SORTED_MIN_IDS, 1) or grad_pooled.shape[1] == 0 or rows.device.type != "cpu":
        return dedupe_reference(rows, bags, scale, grad_pooled)
    unique_rows, crow, perm = _segments(rows)
    grad = grad_pooled.float().contiguous()
    if scale is None or (not isinstance(scale, torch.Tensor) and scale == 1.0):
        return unique_rows, _csr_sum(crow, bags.index_select(0, perm), grad)
    per_id = grad.index_select(0, bags.index_select(0, perm))
    if isinstance(scale, torch.Tensor):
        per_id = per_id * scale.index_select(0, perm).unsqueeze(1)
    else:
        per_id = per_id * scale
    return unique_rows, _csr_sum(crow, torch.arange(n), per_id)


def dedupe_reference(
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | float | None,
    grad_pooled: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`dedupe_sorted` as sorted torch.unique + index_add_ of the [N, D] per-id gradients."""
    grad_rows = grad_pooled.float().index_select(0, bags)
    if isinstance(scale, torch.Tensor):
        grad_rows = grad_rows * scale.unsqueeze(1)
    elif scale is not None and scale != 1.0:
        grad_rows = grad_rows * scale
    unique_rows, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    grads = torch.zeros(unique_rows.numel(), grad_pooled.shape[1], device=grad_rows.device)
    return unique_rows, grads.index_add_(0, inverse, grad_rows)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """t [R, D] viewed as 16-byte words [R, D * itemsize / 16], or None if the layout forbids."""
    size = t.element_size()
    if t.dim() != 2 or t.stride(1) != 1 or (t.shape[1] * size) % 16 or (t.stride(0) * size) % 16:
        return None
    if (t.storage_offset() * size) % 16 or t.data_ptr() % 16:
        return None
    return t.view(_WORD)


def copy_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """dst[rows] = src (rows [U] unique, src [U, ...] of dst's dtype): index_copy_, on 16-byte
    words where both layouts allow (the same bytes, fewer elements to index)."""
    wide_dst, wide_src = _words(dst), _words(src.contiguous())
    if wide_dst is not None and wide_src is not None and dst.device.type == "cpu":
        wide_dst.index_copy_(0, rows, wide_src)
    else:
        dst.index_copy_(0, rows, src)


def gather_rows(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """src[rows] (a new tensor [U, ...]): index_select, on 16-byte words where the layout allows."""
    wide = _words(src)
    if wide is None or src.device.type != "cpu":
        return src.index_select(0, rows)
    return wide.index_select(0, rows).view(src.dtype)


def apply_delta(
    weight: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor, scale: float
) -> None:
    """weight[rows] -= scale * delta, in fp32 (rows unique): the torch path's write-back. The
    rows are read, updated by torch's add kernel (as index_add_ with alpha=-scale, bit for
    bit), rounded once to the weight's dtype and written back whole. Off the CPU: index_add_
    (fp32) or index_copy_, as before."""
    if weight.device.type != "cpu" and weight.dtype == torch.float32:
        weight.index_add_(0, rows, delta, alpha=-scale)
        return
    new = gather_rows(weight, rows).float().sub_(delta, alpha=scale)
    copy_rows(weight, rows, round_to(new, weight.dtype))
