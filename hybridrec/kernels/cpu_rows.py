"""The torch (CPU) path of the sparse backward: gradient dedupe and the rows' write-back.

`dedupe_sorted(rows, bags, scale, grad_pooled)` -> (unique rows [U] ascending, grads [U, D]
fp32), each row's gradient the sum of grad_pooled[bags[i]] * scale[i] over its ids i in id
order, starting from 0. One stable sort of the rows gives the segments; the per-id products
are gathered in that order and `index_add_` adds them position by position, so every row is
summed in id order by construction: the same bits on any CPU (a sparse-matrix product, used
before, adds in an order that differs between CPUs), and the same bits as the native
kernel's hashing dedupe (hybridrec.kernels.native), which sums in id order too.
`dedupe_reference` is the plain form (torch.unique + index_add_ in input order) the tests
compare it with.

`gather_rows(src, rows)` and `copy_rows(dst, rows, src)`: src[rows], and dst[rows] = src for
unique rows, moved as 16-byte words when the row layout allows (index ops cost per element).
`apply_delta`: weight[rows] -= scale * delta, fp32 math (the add kernel's rounding, as
index_add_ with alpha), rounded once.

Legend: N = ids, B = bags, D = width, U = distinct rows.
"""

from __future__ import annotations

import torch

from hybridrec.kernels._common import round_to

_WORD = torch.complex128  # 16 bytes: a pure data-movement view, never computed with
_INT32_MAX = 2**31 - 1


def _segments(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unique rows [U] ascending, counts [U], perm [N]) of a stable sort of `rows`."""
    keys = rows
    if rows.numel() and int(rows.max()) <= _INT32_MAX and int(rows.min()) >= 0:
        keys = rows.to(torch.int32)  # the same stable order, a cheaper sort
    sorted_keys, perm = torch.sort(keys, stable=True)
    unique_keys, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    return unique_keys.to(torch.int64), counts, perm


def dedupe_sorted(
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | float | None,
    grad_pooled: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows [U] ascending, grads [U, D] fp32): per-id gradients grad_pooled[bags[i]] *
    scale[i] summed per distinct row in id order from 0 (module docstring). rows, bags [N]
    int64; scale [N], a float or None. Deterministic on every CPU and thread count."""
    unique_rows, counts, perm = _segments(rows)
    per_id = grad_pooled.float().index_select(0, bags.index_select(0, perm))
    if isinstance(scale, torch.Tensor):
        per_id = per_id * scale.index_select(0, perm).unsqueeze(1)
    elif scale is not None and scale != 1.0:
        per_id = per_id * scale
    segment = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    grads = torch.zeros(unique_rows.numel(), grad_pooled.shape[1], device=per_id.device)
    return unique_rows, grads.index_add_(0, segment, per_id)


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
