"""Triton kernels for the fused embedding lookup, gradient dedupe and row optimizers.

They compute what the pure-torch path computes (hybridrec.sparse.fused `_pool`, `dedupe`;
hybridrec.optim.sparse `SparseSGD`, `RowWiseAdagrad`, `SparseAdam`), with all math in fp32
and one rounding to the weight's dtype per updated value:

- `pooled_lookup`: one program per (bag, column block) sums the bag's rows in fp32.
- `segment_grads`: ids sorted by row (stable), one segment per distinct row. Each program
  takes a fixed tile of SEGMENT_TILE sorted ids and sums the segments in it with a segmented
  scan (no atomics: deterministic, and every program does the same work however skewed the
  ids are); rows whose ids cross tiles (hot rows) leave a piece per tile, which a fix-up kernel
  adds in tile order.
- `sgd_update`, `adam_update`: UPDATE_ROWS // D touched rows per program;
  `rowwise_adagrad_update`: one program per touched row (its mean of g^2 spans the row).

Without host syncs (CUDA graphs, overlap): `segment_grads_padded` sizes everything by N:
stable sort, segment numbers from a cumsum, unique rows written by segment number, and the
tile and fix-up kernels over N positions. It returns rows and grads padded to N and count
[1], a device tensor holding U; the updates take `count=` and skip entries u >= count in the
kernel. `segment_grads` is the same computation cut to U rows (one sync): bit-identical.

Rounding follows torch's CPU ops: fp32 products and sums are rounded separately (launched
with enable_fp_fusion=False), the weight step w - lr * delta is one fma (as torch's index_add_
/ sub_ with alpha), sqrt and division are IEEE (sqrt_rn, div_rn), and bf16 is rounded to
nearest even by hand (Triton's interpreter truncates). SGD, and Adam's moments, are then
bit-identical to the torch path on CPU.

`available(t)` says whether the kernels run on `t`: triton importable, `t` on CUDA or the
Triton interpreter on (TRITON_INTERPRET=1, CPU tensors), and neither `train.kernels=torch`
(`set_kernels`) nor HYBRIDREC_KERNELS=torch in the environment.
Triton picks interpreted or compiled mode when a function is jitted: these kernels are jitted
on first use, once per mode, so TRITON_INTERPRET may be set after import. Triton's own @jit
library functions (tl.zeros, tl.sum, ...) are jitted at `import triton` in the mode of that
moment, so the kernels use builtins only (tl.full; tl.reduce with triton's sum combiner) and
run under the interpreter whenever triton was imported. Row ids are not range-checked (that
would sync with the host); callers pass valid ids as for the torch path.

Legend: N = ids, B = bags, R = weight rows, D = width, U = distinct rows touched (count).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install: fall back to the torch path
    triton = None
    tl = None

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SEGMENT_TILE = 32  # sorted ids per program of segment_grads (rows crossing tiles: fix-up)
UPDATE_ROWS = 2048  # rows x columns per program of sgd/adam updates (rows = this // block_d)
MAX_BLOCK_D = 128  # columns per program (wider rows take several column blocks)
# sorted_segments(rows): (perm [N], seg [N], distinct rows [N] padded)
Segments = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


KERNEL_MODES = ("auto", "torch", "triton")
_mode = "auto"  # set once per process from the config (train.kernels) by set_kernels()


def set_kernels(mode: str, device: torch.device | None = None) -> None:
    """Choose the embedding kernels for this process (`train.kernels`): auto (Triton where it
    can run: CUDA, or CPU under TRITON_INTERPRET=1), torch (never Triton) or triton (refused
    where it cannot run, instead of silently using torch)."""
    global _mode
    if mode not in KERNEL_MODES:
        raise ValueError(f"train.kernels={mode!r} is not one of: {', '.join(KERNEL_MODES)}")
    if mode == "triton":
        if triton is None:
            raise ValueError("train.kernels=triton, but triton is not installed")
        if device is not None and device.type != "cuda" and not _interpreting():
            raise ValueError(
                f"train.kernels=triton needs a CUDA device (or TRITON_INTERPRET=1 to run the "
                f"kernels in Triton's CPU interpreter, for tests); the device is {device}"
            )
    _mode = mode


@contextlib.contextmanager
def use_kernels(mode: str) -> Iterator[None]:
    """set_kernels(mode) inside the block, the previous choice after it (benchmarks and
    tests that time or compare both paths in one process)."""
    previous = _mode
    set_kernels(mode)
    try:
        yield
    finally:
        set_kernels(previous)


def available(t: torch.Tensor) -> bool:
    """True when the Triton kernels run on tensors like `t` (see the module docstring)."""
    if triton is None or _mode == "torch":
        return False
    if os.environ.get("HYBRIDREC_KERNELS", "").strip().lower() == "torch":
        return False
    return t.is_cuda or _interpreting()


# --------------------------------------------------------------------------------------------
# Kernels (plain functions, jitted lazily by _kernels()).


def _pool_kernel(
    weight_ptr,
    rows_ptr,
    offsets_ptr,
    scale_ptr,
    out_ptr,
    D,
    HAS_SCALE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[bag, cols] = sum over the bag's ids of scale * weight[row, cols], summed in fp32
    and rounded once to out's dtype."""
    bag = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    start = tl.load(offsets_ptr + bag)
    end = tl.load(offsets_ptr + bag + 1)
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    for j in range(start, end, BLOCK_N):
        idx = j + tl.arange(0, BLOCK_N)
        id_mask = idx < end
        row = tl.load(rows_ptr + idx, mask=id_mask, other=0)
        vals = tl.load(
            weight_ptr + row[:, None] * D + cols[None, :],
            mask=id_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_SCALE:
            s = tl.load(scale_ptr + idx, mask=id_mask, other=0.0)
            vals = vals * s[:, None]
        acc += tl.reduce(vals, 0, tl.standard._sum_combine)
    if OUT_BF16:  # round to nearest even by hand (the interpreter's cast truncates)
        bits = acc.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(acc != acc, 0x7FC0, bits)  # NaN stays a quiet NaN
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + bag * D + cols, out, mask=col_mask)


if triton is not None:

    @triton.jit
    def _segmented_add(a, a_starts, b, b_starts):
        """Combiner of a segmented sum scan: a segment start resets the running sum."""
        return tl.where(b_starts != 0, b, a + b), a_starts | b_starts


def _segment_tile_kernel(
    grad_ptr,
    perm_ptr,
    bags_ptr,
    scale_ptr,
    seg_ptr,
    out_ptr,
    head_ptr,
    tail_ptr,
    start_tile_ptr,
    N,
    D,
    HAS_SCALE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Tile p of the sorted ids, positions [p * TILE, p * TILE + TILE): each position's
    gradient grad[bags[perm[i]]] * scale[perm[i]], summed per segment (seg [N], the distinct
    row of each position, non-decreasing) by a scan in position order. A segment that lies in
    the tile is stored to out[seg]. A segment that crosses a tile boundary leaves its piece:
    in head[p] when it began in an earlier tile, in tail[p] when it begins here and goes on
    (start_tile[seg] = p); _segment_fixup_kernel adds the pieces."""
    p = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    first = p * TILE
    idx = first + tl.arange(0, TILE)
    inside = idx < N
    last = tl.minimum(first + TILE, N) - 1
    seg = tl.load(seg_ptr + idx, mask=inside, other=-1)
    prev = tl.load(seg_ptr + idx - 1, mask=inside & (idx > 0), other=-1)
    nxt = tl.load(seg_ptr + idx + 1, mask=idx + 1 < N, other=-1)
    ends = inside & (seg != nxt)  # the segment's last position (globally)
    q = tl.load(perm_ptr + idx, mask=inside, other=0)
    bag = tl.load(bags_ptr + q, mask=inside, other=0)
    g = tl.load(
        grad_ptr + bag[:, None] * D + cols[None, :],
        mask=inside[:, None] & col_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    if HAS_SCALE:
        s = tl.load(scale_ptr + q, mask=inside, other=0.0)
        g = g * s[:, None]
    starts = ((seg != prev) | (idx == first)).to(tl.int32)
    acc, _ = tl.associative_scan(
        (g, tl.broadcast_to(starts[:, None], (TILE, BLOCK_D))), 0, _segmented_add
    )
    seg0 = tl.load(seg_ptr + first)
    began_before = (first > 0) & (tl.load(seg_ptr + tl.maximum(first - 1, 0)) == seg0)
    # positions of a segment begun in an earlier tile (the scalar made a block: the
    # interpreter cannot mask with block & scalar)
    cont = (seg == seg0) & (began_before.to(tl.int32) + 0 * idx != 0)
    at_last = idx == last
    to_out = ends & ~cont
    to_head = cont & (ends | at_last)  # one position: that segment's last in this tile
    to_tail = at_last & ~ends & ~cont
    m = col_mask[None, :]
    here = p * D + cols[None, :] + 0 * idx[:, None]
    tl.store(out_ptr + seg[:, None] * D + cols[None, :], acc, mask=to_out[:, None] & m)
    tl.store(head_ptr + here, acc, mask=to_head[:, None] & m)
    tl.store(tail_ptr + here, acc, mask=to_tail[:, None] & m)
    tl.store(start_tile_ptr + seg, p + 0 * idx, mask=to_tail)


def _segment_fixup_kernel(
    seg_ptr,
    head_ptr,
    tail_ptr,
    start_tile_ptr,
    out_ptr,
    N,
    D,
    TILE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """For the segment that began before tile p and ends in it (if any): out[seg] =
    tail[q0] + head[q0 + 1] + ... + head[p], q0 = start_tile[seg], in that order (BLOCK_P
    pieces summed at a time)."""
    p = tl.program_id(0).to(tl.int64)
    first = p * TILE
    seg0 = tl.load(seg_ptr + first)
    if first == 0:
        return
    if tl.load(seg_ptr + first - 1) != seg0:
        return  # the tile's first segment began in it: stored whole, or left as a tail
    last = tl.minimum(first + TILE, N) - 1
    if last + 1 < N:
        if tl.load(seg_ptr + last + 1) == seg0:
            return  # it goes on past this tile: a later tile finishes it
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    q0 = tl.load(start_tile_ptr + seg0)
    acc = tl.load(tail_ptr + q0 * D + cols, mask=col_mask, other=0.0)
    for j in range(q0 + 1, p + 1, BLOCK_P):
        qs = j + tl.arange(0, BLOCK_P)
        piece = tl.load(
            head_ptr + qs[:, None] * D + cols[None, :],
            mask=(qs <= p)[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc += tl.reduce(piece, 0, tl.standard._sum_combine)
    tl.store(out_ptr + seg0 * D + cols, acc, mask=col_mask)


def _sgd_kernel(
    weight_ptr,
    rows_ptr,
    grads_ptr,
    count_ptr,
    n_rows,
    lr,
    D,
    HAS_COUNT: tl.constexpr,
    IS_BF16: tl.constexpr,
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
    if IS_BF16:  # round to nearest even by hand (the interpreter's cast truncates)
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(w != w, 0x7FC0, bits)  # NaN stays a quiet NaN
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = w.to(weight_ptr.dtype.element_ty)
    tl.store(w_ptrs, out, mask=mask)


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
    IS_BF16: tl.constexpr,
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
        if IS_BF16:  # round to nearest even by hand (the interpreter's cast truncates)
            bits = w.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            bits = tl.where(w != w, 0x7FC0, bits)  # NaN stays a quiet NaN
            out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            out = w.to(weight_ptr.dtype.element_ty)
        tl.store(w_ptrs, out, mask=mask)


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
    IS_BF16: tl.constexpr,
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
    if IS_BF16:  # round to nearest even by hand (the interpreter's cast truncates)
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(w != w, 0x7FC0, bits)  # NaN stays a quiet NaN
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = w.to(weight_ptr.dtype.element_ty)
    tl.store(weight_ptr + off, out, mask=mask)


_JITTED: dict[bool, SimpleNamespace] = {}


def _kernels() -> SimpleNamespace:
    """The kernels jitted for the current mode (interpreted or compiled), built once per mode."""
    if triton is None:
        raise RuntimeError("triton is not installed; use the torch path (see available())")
    mode = _interpreting()
    if mode not in _JITTED:
        fns = (
            _pool_kernel,
            _segment_tile_kernel,
            _segment_fixup_kernel,
            _sgd_kernel,
            _adagrad_kernel,
            _adam_kernel,
        )
        _JITTED[mode] = SimpleNamespace(**{f.__name__[1:]: triton.jit(f) for f in fns})
    return _JITTED[mode]


# --------------------------------------------------------------------------------------------
# Input checks and launch helpers.


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_device(ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if not ref.is_cuda and not _interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU ones), got "
            f"{ref.device}"
        )
    for name, t in tensors.items():
        if t is not None:
            _require(t.device == ref.device, f"{name} is on {t.device}, expected {ref.device}")


def _check_weight(weight: torch.Tensor) -> None:
    _require(
        weight.dim() == 2 and weight.dtype in WEIGHT_DTYPES,
        f"weight must be [R, D] fp32/bf16/fp16, got {tuple(weight.shape)} {weight.dtype}",
    )
    _require(weight.is_contiguous(), "weight must be contiguous (it is indexed as row * D)")


def _check_ids(name: str, t: torch.Tensor, n: int | None = None) -> torch.Tensor:
    _require(
        t.dim() == 1 and t.dtype == torch.int64,
        f"{name} must be a 1-d int64 tensor, got {tuple(t.shape)} {t.dtype}",
    )
    if n is not None:
        _require(t.numel() == n, f"{name} must have {n} entries, got {t.numel()}")
    return t.contiguous()


def _check_vector(name: str, t: torch.Tensor, n: int) -> torch.Tensor:
    _require(
        t.dim() == 1 and t.dtype == torch.float32 and t.numel() == n,
        f"{name} must be [{n}] fp32, got {tuple(t.shape)} {t.dtype}",
    )
    return t.contiguous()


def _check_grads(grads: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    u = rows.numel()
    _require(
        grads.dtype == torch.float32 and tuple(grads.shape) == (u, width),
        f"grads must be [{u}, {width}] fp32 (one row per entry of rows), got "
        f"{tuple(grads.shape)} {grads.dtype}",
    )
    return grads.contiguous()


def _block_d(width: int) -> int:
    return min(triton.next_power_of_2(max(width, 1)), MAX_BLOCK_D)


def _block_n(avg_ids: float, block_d: int) -> int:
    """Ids per tile: about the average run length, at most 4096 elements per tile."""
    n = triton.next_power_of_2(max(int(avg_ids + 0.999), 1))
    return max(1, min(n, 32, 4096 // block_d))


def _opts(elements: int) -> dict:
    """Launch options for a tile of `elements` values: 4 per thread (1 to 8 warps), and no
    contraction of a * b + c into fma: the kernels round like torch's ops, fusing only where
    torch fuses (tl.fma in the weight updates)."""
    return {"num_warps": max(1, min(8, elements // 128)), "enable_fp_fusion": False}


# --------------------------------------------------------------------------------------------
# Public ops.


def pooled_lookup(
    weight: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    scale: torch.Tensor | None,
    num_bags: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """pooled [num_bags, D] in out_dtype: pooled[b] = sum_{i in offsets[b]:offsets[b+1]}
    scale[i] * weight[rows[i]], summed in fp32 and rounded once (to nearest even) when
    out_dtype is bf16/fp16: the bits of the fp32 result's .to(out_dtype).

    weight [R, D] fp32/bf16/fp16 contiguous; rows [N] int64; offsets [num_bags + 1] int64,
    non-decreasing, offsets[0] = 0, offsets[-1] = N (empty bags give zero rows); scale [N]
    fp32 or None (all ones). Equals F.embedding_bag(rows, weight.float(), offsets[:-1], "sum",
    per_sample_weights=scale) up to fp32 summation order."""
    _check_weight(weight)
    rows = _check_ids("rows", rows)
    _require(num_bags >= 0, f"num_bags must be >= 0, got {num_bags}")
    offsets = _check_ids("offsets", offsets, num_bags + 1)
    if scale is not None:
        scale = _check_vector("scale", scale, rows.numel())
    _check_device(weight, rows=rows, offsets=offsets, scale=scale)
    width = weight.shape[1]
    _require(out_dtype in WEIGHT_DTYPES, f"out_dtype must be fp32/bf16/fp16, got {out_dtype}")
    out = torch.empty(num_bags, width, dtype=out_dtype, device=weight.device)
    if num_bags == 0 or width == 0:
        return out
    block_d = _block_d(width)
    block_n = _block_n(rows.numel() / num_bags, block_d)
    grid = (num_bags, triton.cdiv(width, block_d))
    _kernels().pool_kernel[grid](
        weight,
        rows,
        offsets,
        scale if scale is not None else rows,
        out,
        width,
        HAS_SCALE=scale is not None,
        OUT_BF16=out_dtype == torch.bfloat16,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        **_opts(block_n * block_d),
    )
    return out


def segment_grads(
    grad_pooled: torch.Tensor,
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows [U] int64 sorted, grads [U, D] fp32): per-id gradients grad_pooled[bags[i]]
    * scale[i] summed per distinct row, as hybridrec.sparse.fused.dedupe.

    grad_pooled [B, D] fp32 (bf16/fp16 are read as fp32); rows, bags [N] int64 (0 <= bags <
    B); scale [N] fp32 or None. Deterministic: segment sums in a fixed order, no atomics.
    Syncs with the host once (U); segment_grads_padded does not."""
    return _segment_grads(grad_pooled, rows, bags, scale, SEGMENT_TILE)


def segment_grads_padded(
    grad_pooled: torch.Tensor,
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | None,
    *,
    segments: Segments | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unique rows [N] int64, grads [N, D] fp32, count [1] int64): segment_grads without a
    host sync, padded to N entries.

    Inputs as segment_grads. The first count[0] entries of unique rows and grads are segment_
    grads' (U = count[0] distinct rows ascending, their summed gradients, bit for bit); past
    count[0], rows repeat the largest row and grads are unspecified (not zeroed). count stays
    on the device: pass it to the updates' `count=`. Deterministic, no atomics. `segments`:
    sorted_segments(rows) when made already (a host cache's admission sorted these rows)."""
    return _segment_grads_padded(grad_pooled, rows, bags, scale, SEGMENT_TILE, segments)


def _check_segment_inputs(
    grad_pooled: torch.Tensor,
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | None,
    tile: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    _require(
        grad_pooled.dim() == 2 and grad_pooled.dtype in WEIGHT_DTYPES,
        f"grad_pooled must be [B, D] fp32/bf16/fp16, got {tuple(grad_pooled.shape)} "
        f"{grad_pooled.dtype}",
    )
    grad_pooled = grad_pooled.contiguous()
    rows = _check_ids("rows", rows)
    n = rows.numel()
    bags = _check_ids("bags", bags, n)
    if scale is not None:
        scale = _check_vector("scale", scale, n)
    _require(tile >= 1 and tile & (tile - 1) == 0, f"tile must be a power of 2, got {tile}")
    _check_device(grad_pooled, rows=rows, bags=bags, scale=scale)
    return grad_pooled, rows, bags, scale


def sorted_segments(rows: torch.Tensor) -> Segments:
    """rows [N] (N >= 1) sorted stably, without a host sync: (perm [N], seg [N]: the distinct
    row of each sorted position, non-decreasing, so U = seg[-1] + 1; unique rows [N]
    ascending, past U repeating the largest row, so every entry indexes a valid row)."""
    sorted_rows, perm = torch.sort(rows, stable=True)
    is_start = torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)
    is_start[1:] = sorted_rows[1:] != sorted_rows[:-1]
    seg = is_start.cumsum(0) - 1
    # every position of a segment writes the same row id: duplicates agree
    unique_rows = sorted_rows[-1:].repeat(rows.numel()).index_put_((seg,), sorted_rows)
    return perm, seg, unique_rows


def _segment_grads(
    grad_pooled: torch.Tensor,
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | None,
    tile: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """segment_grads with `tile` sorted ids per program (tests use small tiles)."""
    unique_rows, grads, count = _segment_grads_padded(grad_pooled, rows, bags, scale, tile)
    u = int(count.item())  # syncs
    return unique_rows[:u], grads[:u]


def _segment_grads_padded(
    grad_pooled: torch.Tensor,
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | None,
    tile: int,
    segments: Segments | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """segment_grads_padded with `tile` sorted ids per program (tests use small tiles).

    Stable sort by row; seg [N] numbers each sorted position's distinct row (a cumsum of
    row changes); a tile kernel sums each segment's gradients within a tile of positions in
    position order, and a fix-up kernel adds the pieces of segments that cross tiles (hot
    rows) in tile order. Every grid is sized from N: nothing waits for the device."""
    grad_pooled, rows, bags, scale = _check_segment_inputs(grad_pooled, rows, bags, scale, tile)
    device, width, n = grad_pooled.device, grad_pooled.shape[1], rows.numel()
    grads = torch.empty(n, width, dtype=torch.float32, device=device)
    if n == 0:
        return rows.new_empty(0), grads, torch.zeros(1, dtype=torch.int64, device=device)
    if segments is None:
        segments = sorted_segments(rows)
    _require(segments[0].numel() == n, f"segments must be for the {n} rows given")
    perm, seg, unique_rows = segments
    count = seg[-1:] + 1
    if width:
        tiles, block_d = triton.cdiv(n, tile), _block_d(width)
        head = torch.empty(tiles, width, dtype=torch.float32, device=device)
        tail = torch.empty_like(head)
        start_tile = torch.empty(n, dtype=torch.int64, device=device)
        grid = (tiles, triton.cdiv(width, block_d))
        kern = _kernels()
        kern.segment_tile_kernel[grid](
            grad_pooled,
            perm,
            bags,
            scale if scale is not None else grad_pooled,
            seg,
            grads,
            head,
            tail,
            start_tile,
            n,
            width,
            HAS_SCALE=scale is not None,
            TILE=tile,
            BLOCK_D=block_d,
            **_opts(tile * block_d),
        )
        block_p = max(1, min(32, 4096 // block_d))
        kern.segment_fixup_kernel[grid](
            seg,
            head,
            tail,
            start_tile,
            grads,
            n,
            width,
            TILE=tile,
            BLOCK_P=block_p,
            BLOCK_D=block_d,
            **_opts(block_p * block_d),
        )
    return unique_rows, grads, count


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
    _kernels().sgd_kernel[(triton.cdiv(rows.numel(), block_r), triton.cdiv(width, block_d))](
        weight,
        rows,
        grads,
        count if count is not None else rows,
        rows.numel(),
        float(lr),
        width,
        HAS_COUNT=count is not None,
        IS_BF16=weight.dtype == torch.bfloat16,
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
    _kernels().adagrad_kernel[(rows.numel(),)](
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
        IS_BF16=weight.dtype == torch.bfloat16,
        BLOCK_D=block_d,
        **_opts(block_d),
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
    _kernels().adam_kernel[(triton.cdiv(rows.numel(), block_r), triton.cdiv(width, block_d))](
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
        IS_BF16=weight.dtype == torch.bfloat16,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        **_opts(block_r * block_d),
    )
