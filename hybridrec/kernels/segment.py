"""Gradient dedupe: per-id gradients grad_pooled[bags[i]] * scale[i], summed per distinct row.

`dedupe` is what the embedding groups call: `segment_grads` where Triton runs, else
`cpu_rows.dedupe_sorted` (one stable sort, index_add_ in id order); `dedupe_any_order` may
return the rows unsorted, which lets the CPU hash them instead (`native.dedupe_hashed`, the
same sums).
The kernels: ids sorted by row (stable), one segment per distinct row. Each program takes a
fixed tile of SEGMENT_TILE sorted ids and sums the segments in it with a segmented scan (no
atomics: deterministic, and every program does the same work however skewed the ids are);
rows whose ids cross tiles (hot rows) leave a piece per tile, which a fix-up kernel adds in
tile order.

Without host syncs (CUDA graphs, overlap): `segment_grads_padded` sizes everything by N: stable
sort, segment numbers from a cumsum, unique rows written by segment number, the kernels over N
positions. It returns rows and grads padded to N and count [1], a device tensor holding U (the
row updates take it as `count=`). `segment_grads` is the same computation cut to U rows (one
sync): bit-identical.

Legend: N = ids, B = bags, D = width, U = distinct rows (count).
"""

from __future__ import annotations

import torch

from hybridrec.kernels import _common, native
from hybridrec.kernels._common import (
    WEIGHT_DTYPES,
    _block_d,
    _check_device,
    _check_ids,
    _check_vector,
    _opts,
    _require,
    device_function,
    tl,
    triton,
)
from hybridrec.kernels.cpu_rows import dedupe_sorted
from hybridrec.kernels.dispatch import available

SEGMENT_TILE = 32  # sorted ids per program of segment_grads (rows crossing tiles: fix-up)
# sorted_segments(rows): (perm [N], seg [N], distinct rows [N] padded)
Segments = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@device_function
def _segmented_add(a, a_starts, b, b_starts):  # noqa: ANN001, ANN202
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


def segment_grads(
    grad_pooled: torch.Tensor,
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows [U] int64 sorted, grads [U, D] fp32): per-id gradients grad_pooled[bags[i]]
    * scale[i] summed per distinct row, as `dedupe`.

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
        _common.jitted(_segment_tile_kernel)[grid](
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
        _common.jitted(_segment_fixup_kernel)[grid](
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


def scale_tensor(scale: torch.Tensor | float | None, rows: torch.Tensor) -> torch.Tensor | None:
    """Per-id pooling scale [N] fp32 for the Triton kernels (None: all ones)."""
    if isinstance(scale, torch.Tensor) or scale is None:
        return scale
    if scale == 1.0:
        return None
    return torch.full(rows.shape, float(scale), dtype=torch.float32, device=rows.device)


def dedupe(
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | float | None,
    grad_pooled: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-id gradients summed per distinct row: (unique rows [U] sorted, grads [U, D] fp32).

    With Triton: a sort and one segment-sum kernel (deterministic, no atomics); on the CPU
    the native hashing dedupe, its rows then sorted (the same sums, in id order); else
    hybridrec.kernels.cpu_rows.dedupe_sorted (one sort, index_add_ in id order)."""
    if available(grad_pooled):
        return segment_grads(grad_pooled, rows, bags, scale_tensor(scale, rows))
    if grad_pooled.device.type == "cpu" and native.usable(rows, bags):
        unique_rows, grads = native.dedupe_hashed(rows, bags, scale, grad_pooled)
        unique_rows, order = unique_rows.sort()
        return unique_rows, grads.index_select(0, order)
    return dedupe_sorted(rows, bags, scale, grad_pooled)


def dedupe_any_order(
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | float | None,
    grad_pooled: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`dedupe` for callers that take the distinct rows in any order: on the CPU with the
    native kernels, one hashing pass (rows in first-occurrence order; each row's sum is
    `dedupe`'s, bit for bit); else `dedupe` (sorted)."""
    if grad_pooled.device.type == "cpu" and native.usable(rows, bags):
        return native.dedupe_hashed(rows, bags, scale, grad_pooled)
    return dedupe(rows, bags, scale, grad_pooled)
