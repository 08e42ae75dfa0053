"""Row optimizer updates on the touched rows: SGD, Adagrad, row-wise Adagrad and lazy Adam
kernels (the torch path's write-back, `apply_delta`, is hybridrec.kernels.cpu_rows').

The math is hybridrec.optim.sparse's (SparseSGD, SparseAdagrad, RowWiseAdagrad, SparseAdam):
fp32 state and arithmetic, one rounding to the weight's dtype per updated value
(`round_for_store`; torch: `round_to`). SGD, Adagrad's sums and Adam's moments are
bit-identical to the torch path on CPU.
`sgd_update`, `adagrad_update`, `adam_update`: UPDATE_ROWS // D touched rows per program;
`rowwise_adagrad_update`: one program per touched row (its mean of g^2 spans the row).
Inputs may be padded (from segment_grads_padded): `count=` [1] int64 on the device, and the
kernels skip entries u >= count, so nothing waits for the host. Row ids are not range-checked
(that would sync with the host); callers pass valid, unique rows as for the torch path.

Legend: R = weight rows, D = width, U = rows updated (rows given, or count).
"""

from __future__ import annotations

import torch

from hybridrec.kernels import _common
from hybridrec.kernels._common import (
    _block_d,
    _check_device,
    _check_ids,
    _check_vector,
    _check_weight,
    _opts,
    _require,
    round_for_store,
    tl,
    triton,
)

UPDATE_ROWS = 2048  # rows x columns per program of element-wise updates (rows = this // block_d)


def _sgd_kernel(
    weight_ptr,
    rows_ptr,
    grads_ptr,
    count_ptr,
    n_rows,
    lr,
    D,
    HAS_COUNT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """weight[rows[u], cols] -= lr * grads[u, cols] for BLOCK_R entries u per program
    (u < count[0] if HAS_COUNT, else u < n_rows)."""
    us = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    if HAS_COUNT:
        n_rows = tl.load(count_ptr)
    if tl.program_id(0).to(tl.int64) * BLOCK_R >= n_rows:
        return
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = us < n_rows
    mask = row_mask[:, None] & (cols < D)[None, :]
    row = tl.load(rows_ptr + us, mask=row_mask, other=0)
    w_ptrs = weight_ptr + row[:, None] * D + cols[None, :]
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(grads_ptr + us[:, None] * D + cols[None, :], mask=mask, other=0.0)
    w = tl.fma(g, -lr, w)  # torch's index_add_(alpha=-lr) / sub_(alpha=lr): one rounding
    tl.store(w_ptrs, round_for_store(w, weight_ptr), mask=mask)


def _adagrad_kernel(
    weight_ptr,
    acc_ptr,
    rows_ptr,
    grads_ptr,
    row_sq_ptr,
    count_ptr,
    lr,
    eps,
    inv_d,
    D,
    HAS_ROW_SQ: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """s = acc[row] + mean(g^2); acc[row] = s; weight[row] -= lr * g / (sqrt(s) + eps)
    (for u < count[0] if HAS_COUNT)."""
    u = tl.program_id(0).to(tl.int64)
    if HAS_COUNT:
        if u >= tl.load(count_ptr):
            return
    row = tl.load(rows_ptr + u)
    if HAS_ROW_SQ:
        sq_mean = tl.load(row_sq_ptr + u)
    else:
        sq = tl.full([BLOCK_D], 0.0, tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            g = tl.load(grads_ptr + u * D + cols, mask=cols < D, other=0.0)
            sq += g * g
        sq_mean = tl.reduce(sq, 0, tl.standard._sum_combine) * inv_d
    s = tl.load(acc_ptr + row) + sq_mean
    tl.store(acc_ptr + row, s)
    denom = tl.sqrt_rn(s) + eps
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = cols < D
        g = tl.load(grads_ptr + u * D + cols, mask=mask, other=0.0)
        w_ptrs = weight_ptr + row * D + cols
        w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
        w = tl.fma(tl.div_rn(g, denom), -lr, w)
        tl.store(w_ptrs, round_for_store(w, weight_ptr), mask=mask)


def _elementwise_adagrad_kernel(
    weight_ptr,
    acc_ptr,
    rows_ptr,
    grads_ptr,
    count_ptr,
    n_rows,
    lr,
    eps,
    D,
    HAS_COUNT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """s = acc[row] + g^2 per element; acc[row] = s; weight[row] -= lr * g / (sqrt(s) + eps),
    for BLOCK_R entries u per program (u < count[0] if HAS_COUNT, else u < n_rows)."""
    us = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    if HAS_COUNT:
        n_rows = tl.load(count_ptr)
    if tl.program_id(0).to(tl.int64) * BLOCK_R >= n_rows:
        return
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = us < n_rows
    mask = row_mask[:, None] & (cols < D)[None, :]
    row = tl.load(rows_ptr + us, mask=row_mask, other=0)
    off = row[:, None] * D + cols[None, :]
    g = tl.load(grads_ptr + us[:, None] * D + cols[None, :], mask=mask, other=0.0)
    s = tl.fma(g, g, tl.load(acc_ptr + off, mask=mask, other=0.0))  # torch addcmul_: one rounding
    tl.store(acc_ptr + off, s, mask=mask)
    w = tl.load(weight_ptr + off, mask=mask, other=0.0).to(tl.float32)
    w = tl.fma(tl.div_rn(g, tl.sqrt_rn(s) + eps), -lr, w)
    tl.store(weight_ptr + off, round_for_store(w, weight_ptr), mask=mask)


def _adam_kernel(
    weight_ptr,
    m_ptr,
    v_ptr,
    rows_ptr,
    grads_ptr,
    count_ptr,
    n_rows,
    step_size,
    one_minus_beta1,
    one_minus_beta2,
    eps,
    D,
    HAS_COUNT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Lazy Adam on rows rows[u]: m, v move toward g, g^2; w -= step_size * m / (sqrt(v) + eps),
    for BLOCK_R entries u per program (u < count[0] if HAS_COUNT, else u < n_rows)."""
    us = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    if HAS_COUNT:
        n_rows = tl.load(count_ptr)
    if tl.program_id(0).to(tl.int64) * BLOCK_R >= n_rows:
        return
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = us < n_rows
    mask = row_mask[:, None] & (cols < D)[None, :]
    row = tl.load(rows_ptr + us, mask=row_mask, other=0)
    off = row[:, None] * D + cols[None, :]
    g = tl.load(grads_ptr + us[:, None] * D + cols[None, :], mask=mask, other=0.0)
    m = tl.load(m_ptr + off, mask=mask, other=0.0)
    v = tl.load(v_ptr + off, mask=mask, other=0.0)
    m = (g - m) * one_minus_beta1 + m
    v = (g * g - v) * one_minus_beta2 + v
    tl.store(m_ptr + off, m, mask=mask)
    tl.store(v_ptr + off, v, mask=mask)
    w = tl.load(weight_ptr + off, mask=mask, other=0.0).to(tl.float32)
    w = tl.fma(tl.div_rn(m, tl.sqrt_rn(v) + eps), -step_size, w)
    tl.store(weight_ptr + off, round_for_store(w, weight_ptr), mask=mask)


def _check_grads(grads: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    u = rows.numel()
    _require(
        grads.dtype == torch.float32 and tuple(grads.shape) == (u, width),
        f"grads must be [{u}, {width}] fp32 (one row per entry of rows), got "
        f"{tuple(grads.shape)} {grads.dtype}",
    )
    return grads.contiguous()


def _check_count(count: torch.Tensor | None) -> None:
    if count is not None:
        _require(
            count.dtype == torch.int64 and count.numel() == 1,
            f"count must be a [1] int64 tensor, got {tuple(count.shape)} {count.dtype}",
        )


def sgd_update(
    weight: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    *,
    count: torch.Tensor | None = None,
) -> None:
    """weight[rows] -= lr * grads in fp32, rounded once to weight's dtype.

    weight [R, D] fp32/bf16/fp16 contiguous (updated in place); rows [U] int64, unique;
    grads [U, D] fp32. count [1] int64 on the device, or None: only the first count[0] entries
    of rows / grads are used (the rest may be padding, as from segment_grads_padded), read by
    the kernel: no host sync."""
    _check_weight(weight)
    rows = _check_ids("rows", rows)
    grads = _check_grads(grads, rows, weight.shape[1])
    _check_count(count)
    _check_device(weight, rows=rows, grads=grads, count=count)
    width = weight.shape[1]
    if rows.numel() == 0 or width == 0:
        return
    block_d = _block_d(width)
    block_r = max(1, UPDATE_ROWS // block_d)
    grid = (triton.cdiv(rows.numel(), block_r), triton.cdiv(width, block_d))
    _common.jitted(_sgd_kernel)[grid](
        weight,
        rows,
        grads,
        count if count is not None else rows,
        rows.numel(),
        float(lr),
        width,
        HAS_COUNT=count is not None,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        **_opts(block_r * block_d),
    )


def rowwise_adagrad_update(
    weight: torch.Tensor,
    acc: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    eps: float,
    row_sq_mean: torch.Tensor | None = None,
    *,
    count: torch.Tensor | None = None,
) -> None:
    """Row-wise Adagrad on rows `rows`, as hybridrec.optim.sparse.RowWiseAdagrad.update:
    s = acc[rows] + (row_sq_mean or mean(g^2) over the row); acc[rows] = s;
    weight[rows] -= lr * g / (sqrt(s) + eps).

    weight [R, D] fp32/bf16/fp16 and acc [R] fp32, contiguous, updated in place; rows [U]
    int64, unique; grads [U, D] fp32; row_sq_mean [U] fp32 or None. count [1] int64 on the
    device, or None: only the first count[0] entries of rows / grads / row_sq_mean are used
    (as sgd_update)."""
    _check_weight(weight)
    r, width = weight.shape
    _require(
        acc.dim() == 1 and acc.dtype == torch.float32 and acc.numel() == r,
        f"acc must be [{r}] fp32 (one sum per weight row), got {tuple(acc.shape)} {acc.dtype}",
    )
    _require(acc.is_contiguous(), "acc must be contiguous")
    rows = _check_ids("rows", rows)
    grads = _check_grads(grads, rows, width)
    if row_sq_mean is not None:
        row_sq_mean = _check_vector("row_sq_mean", row_sq_mean, rows.numel())
    _check_count(count)
    _check_device(weight, acc=acc, rows=rows, grads=grads, row_sq_mean=row_sq_mean, count=count)
    if rows.numel() == 0:
        return
    block_d = _block_d(width)
    _common.jitted(_adagrad_kernel)[(rows.numel(),)](
        weight,
        acc,
        rows,
        grads,
        row_sq_mean if row_sq_mean is not None else acc,
        count if count is not None else rows,
        float(lr),
        float(eps),
        1.0 / width if width else 0.0,
        width,
        HAS_ROW_SQ=row_sq_mean is not None,
        HAS_COUNT=count is not None,
        BLOCK_D=block_d,
        **_opts(block_d),
    )


def adagrad_update(
    weight: torch.Tensor,
    acc: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    eps: float,
    *,
    count: torch.Tensor | None = None,
) -> None:
    """Element-wise Adagrad on rows `rows`, as hybridrec.optim.sparse.SparseAdagrad.update:
    s = acc[rows] + g^2; acc[rows] = s; weight[rows] -= lr * g / (sqrt(s) + eps).

    weight [R, D] fp32/bf16/fp16 and acc [R, D] fp32, contiguous, updated in place; rows [U]
    int64, unique; grads [U, D] fp32. count [1] int64 on the device, or None: only the first
    count[0] entries of rows / grads are used (as sgd_update)."""
    _check_weight(weight)
    _require(
        acc.dtype == torch.float32 and acc.shape == weight.shape,
        f"acc must be {list(weight.shape)} fp32 like weight, got {tuple(acc.shape)} {acc.dtype}",
    )
    _require(acc.is_contiguous(), "acc must be contiguous")
    rows = _check_ids("rows", rows)
    width = weight.shape[1]
    grads = _check_grads(grads, rows, width)
    _check_count(count)
    _check_device(weight, acc=acc, rows=rows, grads=grads, count=count)
    if rows.numel() == 0 or width == 0:
        return
    block_d = _block_d(width)
    block_r = max(1, UPDATE_ROWS // block_d)
    grid = (triton.cdiv(rows.numel(), block_r), triton.cdiv(width, block_d))
    _common.jitted(_elementwise_adagrad_kernel)[grid](
        weight,
        acc,
        rows,
        grads,
        count if count is not None else rows,
        rows.numel(),
        float(lr),
        float(eps),
        width,
        HAS_COUNT=count is not None,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        **_opts(block_r * block_d),
    )


def adam_update(
    weight: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    step_size: float,
    beta1: float,
    beta2: float,
    eps: float,
    *,
    count: torch.Tensor | None = None,
) -> None:
    """Lazy Adam on rows `rows`, as hybridrec.optim.sparse.SparseAdam.update: m += (1 - beta1)
    (g - m); v += (1 - beta2)(g^2 - v); weight -= step_size * m / (sqrt(v) + eps), with
    step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t) computed by the caller.

    weight [R, D] fp32/bf16/fp16, exp_avg and exp_avg_sq [R, D] fp32, contiguous, updated in
    place; rows [U] int64, unique; grads [U, D] fp32. count [1] int64 on the device, or None:
    only the first count[0] entries of rows / grads are used (as sgd_update)."""
    _check_weight(weight)
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _require(
            t.dtype == torch.float32 and t.shape == weight.shape,
            f"{name} must be {list(weight.shape)} fp32 like weight, got {tuple(t.shape)} {t.dtype}",
        )
        _require(t.is_contiguous(), f"{name} must be contiguous")
    rows = _check_ids("rows", rows)
    width = weight.shape[1]
    grads = _check_grads(grads, rows, width)
    _check_count(count)
    _check_device(
        weight, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, rows=rows, grads=grads, count=count
    )
    if rows.numel() == 0 or width == 0:
        return
    block_d = _block_d(width)
    block_r = max(1, UPDATE_ROWS // block_d)
    grid = (triton.cdiv(rows.numel(), block_r), triton.cdiv(width, block_d))
    _common.jitted(_adam_kernel)[grid](
        weight,
        exp_avg,
        exp_avg_sq,
        rows,
        grads,
        count if count is not None else rows,
        rows.numel(),
        float(step_size),
        1.0 - beta1,
        1.0 - beta2,
        float(eps),
        width,
        HAS_COUNT=count is not None,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        **_opts(block_r * block_d),
    )
