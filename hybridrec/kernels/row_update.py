"""Row optimizer updates on the touched rows: one Triton launcher for every optimizer.

`update(opt, weight, state, rows, grads, step, row_sq_mean, count=)` runs one step of row
optimizer `opt` (hybridrec.kernels.maths.RowMaths: SparseSGD, SparseAdagrad, RowWiseAdagrad,
SparseAdam of hybridrec.optim.sparse) on weight rows `rows`. The launcher checks the inputs,
sizes the grid and launches one of two kernels, each calling the optimizer's maths
(`opt.triton`, a device function passed as a constexpr):
- `_tile_update_kernel`: element-wise maths (element-wise state [R, D] or none):
  UPDATE_ROWS // D touched rows per program, one column block each;
- `_row_update_kernel`: maths that reads each row's mean of g^2 over its full width
  (`opt.needs_full_row_stat`; row-wise state [R]): one program per touched row.
The maths is called as maths(w, g, s0, s1, stat, h0, h1, h2, h3) -> (w, s0, s1): w the
weight values in fp32, g their gradients, s0 and s1 the state values in state_spec order,
stat the row's mean(g^2), h0..h3 `opt.scalars(step)`; it returns the new weight (w - step,
one fma as torch's sub_ with alpha) and the new state. At most MAX_STATES state tensors and
MAX_SCALARS scalars; unused ones are placeholders, neither loaded nor stored.

fp32 state and arithmetic, one rounding to the weight's dtype per updated value
(`round_for_store`; torch: `round_to`). Weight decay (DECAY, hybridrec.kernels.decay.Decay)
is applied to the values before the maths: L2 g += w * wd, decoupled w *= 1 - lr * wd, with
wd the scalar `wd` or, with WD_ROWS, wd_rows[u] (a group of tables with their own decays).
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
from hybridrec.kernels.decay import DECOUPLED, L2, Decay, decay_of
from hybridrec.kernels.maths import RowMaths
from hybridrec.types import StateKind

if (L2, DECOUPLED) != (1, 2):  # the kernels test DECAY against these literals
    raise ImportError("hybridrec.kernels.decay's L2 and DECOUPLED must be 1 and 2")

UPDATE_ROWS = 2048  # rows x columns per program of element-wise updates (rows = this // block_d)
MAX_STATES = 2  # state tensors the kernels take (s0, s1)
MAX_SCALARS = 4  # scalars the kernels take (h0..h3)


def _tile_update_kernel(
    weight_ptr,
    rows_ptr,
    grads_ptr,
    count_ptr,
    s0_ptr,
    s1_ptr,
    wd_ptr,
    n_rows,
    h0,
    h1,
    h2,
    h3,
    wd,
    decay_lr,
    D,
    MATHS: tl.constexpr,
    STATES: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    DECAY: tl.constexpr,
    WD_ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Element-wise maths on weight[rows[u], cols] and its STATES state tensors [R, D], for
    BLOCK_R entries u per program (u < count[0] if HAS_COUNT, else u < n_rows), after the
    DECAY of the values (wd_ptr[u] per row if WD_ROWS, else wd)."""
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
    s0 = g  # placeholders where the optimizer keeps less state
    s1 = g
    if STATES > 0:
        s0 = tl.load(s0_ptr + off, mask=mask, other=0.0)
    if STATES > 1:
        s1 = tl.load(s1_ptr + off, mask=mask, other=0.0)
    w = tl.load(weight_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if DECAY != 0:
        wdr = wd
        if WD_ROWS:
            wdr = tl.load(wd_ptr + us, mask=row_mask, other=0.0)[:, None]
        if DECAY == 1:  # L2 (a literal: a kernel reads no non-constexpr global)
            g = g + w * wdr
        else:  # DECOUPLED
            w = w * (1.0 - decay_lr * wdr)
    w, s0, s1 = MATHS(w, g, s0, s1, 0.0, h0, h1, h2, h3)
    if STATES > 0:
        tl.store(s0_ptr + off, s0, mask=mask)
    if STATES > 1:
        tl.store(s1_ptr + off, s1, mask=mask)
    tl.store(weight_ptr + off, round_for_store(w, weight_ptr), mask=mask)


def _row_update_kernel(
    weight_ptr,
    rows_ptr,
    grads_ptr,
    count_ptr,
    s0_ptr,
    s1_ptr,
    row_sq_ptr,
    wd_ptr,
    h0,
    h1,
    h2,
    h3,
    wd,
    decay_lr,
    inv_d,
    D,
    MATHS: tl.constexpr,
    STATES: tl.constexpr,
    HAS_ROW_SQ: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    DECAY: tl.constexpr,
    WD_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Row maths on weight[rows[u]] with stat = row_sq[u] (HAS_ROW_SQ) or mean(g^2) over the
    row (of the gradient the maths see: under L2 decay g + w * wd), and STATES row-wise state
    tensors [R], one program per entry u (u < count[0] if HAS_COUNT), after the DECAY of the
    values (wd_ptr[u] if WD_ROWS, else wd). The state is read once, before the row's column
    blocks, and written after."""
    u = tl.program_id(0).to(tl.int64)
    if HAS_COUNT:
        if u >= tl.load(count_ptr):
            return
    row = tl.load(rows_ptr + u)
    wdr = wd
    if WD_ROWS:
        wdr = tl.load(wd_ptr + u)
    keep = 1.0 - decay_lr * wdr  # decoupled decay's factor
    if HAS_ROW_SQ:
        stat = tl.load(row_sq_ptr + u)
    else:
        sq = tl.full([BLOCK_D], 0.0, tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            g = tl.load(grads_ptr + u * D + cols, mask=cols < D, other=0.0)
            if DECAY == 1:  # L2
                w0 = tl.load(weight_ptr + row * D + cols, mask=cols < D, other=0.0)
                g = g + w0.to(tl.float32) * wdr
            sq += g * g
        stat = tl.reduce(sq, 0, tl.standard._sum_combine) * inv_d
    s0 = stat  # placeholders where the optimizer keeps less state
    s1 = stat
    if STATES > 0:
        s0 = tl.load(s0_ptr + row)
    if STATES > 1:
        s1 = tl.load(s1_ptr + row)
    new0 = s0
    new1 = s1
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = cols < D
        g = tl.load(grads_ptr + u * D + cols, mask=mask, other=0.0)
        w_ptrs = weight_ptr + row * D + cols
        w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
        if DECAY == 1:  # L2
            g = g + w * wdr
        if DECAY == 2:  # DECOUPLED
            w = w * keep
        w, new0, new1 = MATHS(w, g, s0, s1, stat, h0, h1, h2, h3)
        tl.store(w_ptrs, round_for_store(w, weight_ptr), mask=mask)
    if STATES > 0:
        tl.store(s0_ptr + row, new0)
    if STATES > 1:
        tl.store(s1_ptr + row, new1)


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


def _check_states(
    opt: RowMaths, weight: torch.Tensor, state: dict[str, torch.Tensor]
) -> list[torch.Tensor]:
    """`state`'s tensors in state_spec order, each [R] (row-wise) or like weight (element-
    wise) fp32 contiguous; row-wise state only for per-row maths, element-wise only for
    element-wise maths (the two kernels)."""
    spec = opt.state_spec()
    _require(
        set(state) == set(spec),
        f"{opt.name} keeps state {sorted(spec)}, got {sorted(state)}",
    )
    _require(len(spec) <= MAX_STATES, f"the row kernels take at most {MAX_STATES} states")
    r, width = weight.shape
    out = []
    for name, kind in spec.items():
        t = state[name]
        if StateKind(kind) is StateKind.ROW:
            _require(
                opt.needs_full_row_stat,
                f"{opt.name}: row-wise state {name!r} needs per-row maths (needs_full_row_stat)",
            )
            _require(
                t.dim() == 1 and t.dtype == torch.float32 and t.numel() == r,
                f"{name} must be [{r}] fp32 (one value per weight row), got "
                f"{tuple(t.shape)} {t.dtype}",
            )
        else:
            _require(
                not opt.needs_full_row_stat,
                f"{opt.name}: element-wise state {name!r} needs element-wise maths",
            )
            _require(
                t.dtype == torch.float32 and t.shape == weight.shape,
                f"{name} must be {[r, width]} fp32 like weight, got {tuple(t.shape)} {t.dtype}",
            )
        _require(t.is_contiguous(), f"{name} must be contiguous")
        out.append(t)
    return out


def update(
    opt: RowMaths,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grads: torch.Tensor,
    step: int,
    row_sq_mean: torch.Tensor | None = None,
    *,
    count: torch.Tensor | None = None,
    decay: Decay | None = None,
) -> None:
    """One step of row optimizer `opt` at optimizer step `step` on weight rows `rows`, in
    place: as opt's torch maths (hybridrec.kernels.rows), in one kernel, after `decay`
    (hybridrec.kernels.rows.Decay; None: opt's own weight_decay for every row).

    weight [R, D] fp32/bf16/fp16 contiguous; state name -> [R] or [R, D] fp32 contiguous, as
    opt.state_spec(); rows [U] int64, unique; grads [U, D] fp32; row_sq_mean [U] fp32 or None
    (each row's mean(g^2) over its full width, read where opt.needs_full_row_stat, else
    computed from grads; ignored by element-wise maths). count [1] int64 on the device, or
    None: only the first count[0] entries of rows / grads / row_sq_mean are used (the rest may
    be padding, as from segment_grads_padded), read by the kernel: no host sync."""
    _check_weight(weight)
    states = _check_states(opt, weight, state)
    rows = _check_ids("rows", rows)
    r, width = weight.shape
    grads = _check_grads(grads, rows, width)
    per_row = opt.needs_full_row_stat
    if not per_row:
        row_sq_mean = None
    elif row_sq_mean is not None:
        row_sq_mean = _check_vector("row_sq_mean", row_sq_mean, rows.numel())
    _check_count(count)
    if decay is None:
        decay = decay_of(opt)
    wd_rows = decay.rows
    if wd_rows is not None:
        wd_rows = _check_vector("weight decay per row", wd_rows, rows.numel())
    named = {f"state {n!r}": t for n, t in zip(opt.state_spec(), states, strict=True)}
    _check_device(
        weight, rows=rows, grads=grads, row_sq_mean=row_sq_mean, count=count,
        weight_decay=wd_rows, **named,
    )  # fmt: skip
    scalars = [float(h) for h in opt.scalars(step)]
    _require(len(scalars) <= MAX_SCALARS, f"the row kernels take at most {MAX_SCALARS} scalars")
    h = scalars + [0.0] * (MAX_SCALARS - len(scalars))
    s = states + [weight] * (MAX_STATES - len(states))  # placeholders: never read
    if rows.numel() == 0 or width == 0:
        return
    counted = count if count is not None else rows  # a placeholder pointer without count
    decay_args = (decay.value, decay.lr)
    decay_flags = {"DECAY": decay.kind, "WD_ROWS": wd_rows is not None}
    wd_ptr = wd_rows if wd_rows is not None else grads  # a placeholder: never read
    block_d = _block_d(width)
    if per_row:
        _common.jitted(_row_update_kernel)[(rows.numel(),)](
            weight,
            rows,
            grads,
            counted,
            *s,
            row_sq_mean if row_sq_mean is not None else grads,
            wd_ptr,
            *h,
            *decay_args,
            1.0 / width,
            width,
            MATHS=opt.triton,
            STATES=len(states),
            HAS_ROW_SQ=row_sq_mean is not None,
            HAS_COUNT=count is not None,
            **decay_flags,
            BLOCK_D=block_d,
            **_opts(block_d),
        )
        return
    block_r = max(1, UPDATE_ROWS // block_d)
    grid = (triton.cdiv(rows.numel(), block_r), triton.cdiv(width, block_d))
    _common.jitted(_tile_update_kernel)[grid](
        weight,
        rows,
        grads,
        counted,
        *s,
        wd_ptr,
        rows.numel(),
        *h,
        *decay_args,
        width,
        MATHS=opt.triton,
        STATES=len(states),
        HAS_COUNT=count is not None,
        **decay_flags,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        **_opts(block_r * block_d),
    )
