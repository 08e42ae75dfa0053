"""Pooled embedding lookup: pooled[b] = sum over bag b's ids i of scale[i] * weight[rows[i]].

`pool` is what the embedding groups call: the Triton kernel where it runs (`available`),
else torch ops (`pool_fp32`). Both sum in fp32 and round once to out_dtype, so a bf16/fp16
output holds the bits of the fp32 sum's .to(out_dtype). `pooled_lookup` is the kernel's op:
one program per (bag, column block) sums the bag's rows in fp32.

Legend: N = ids, B = bags (num_bags), R = weight rows, D = width.
"""

from __future__ import annotations

import torch

from hybridrec.kernels import _common
from hybridrec.kernels._common import (
    WEIGHT_DTYPES,
    _block_d,
    _check_device,
    _check_ids,
    _check_vector,
    _check_weight,
    _opts,
    _require,
    round_for_store,
    round_to,
    tl,
    triton,
)
from hybridrec.kernels.dispatch import available


def _pool_kernel(
    weight_ptr,
    rows_ptr,
    offsets_ptr,
    scale_ptr,
    out_ptr,
    D,
    HAS_SCALE: tl.constexpr,
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
    tl.store(out_ptr + bag * D + cols, round_for_store(acc, out_ptr), mask=col_mask)


def _block_n(avg_ids: float, block_d: int) -> int:
    """Ids per tile: about the average run length, at most 4096 elements per tile."""
    n = triton.next_power_of_2(max(int(avg_ids + 0.999), 1))
    return max(1, min(n, 32, 4096 // block_d))


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
    _common.jitted(_pool_kernel)[grid](
        weight,
        rows,
        offsets,
        scale if scale is not None else rows,
        out,
        width,
        HAS_SCALE=scale is not None,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        **_opts(block_n * block_d),
    )
    return out


def pool(
    weight: torch.Tensor,
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | None,
    num_bags: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """pooled [num_bags, D]: pooled[bags[i]] += scale[i] * weight[rows[i]], summed in fp32,
    returned in out_dtype (rounded once: the bits of the fp32 sum's .to(out_dtype)).

    `bags` must be non-decreasing (every producer in hybridrec lays ids out bag by bag). Where
    Triton runs (`available`) one kernel does it all (`pooled_lookup`); else `pool_fp32`."""
    if available(weight):
        ends = torch.arange(num_bags + 1, device=bags.device, dtype=bags.dtype)
        offsets = torch.searchsorted(bags, ends)
        return pooled_lookup(weight, rows, offsets, scale, num_bags, out_dtype)
    return round_to(pool_fp32(weight, rows, bags, scale, num_bags), out_dtype)


def pool_fp32(
    weight: torch.Tensor,
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | None,
    num_bags: int,
) -> torch.Tensor:
    """`pool` by torch ops, in fp32. fp32 tables use torch's embedding_bag kernel (faster than
    gather + index_add_ on CPU). Bag starts: bincount on CPU (fastest there); searchsorted
    on CUDA, where bincount would sync with the host to size its output. Low-precision tables
    gather, convert and sum in fp32."""
    if weight.dtype == torch.float32:
        if bags.is_cuda:
            starts = torch.arange(num_bags, device=bags.device, dtype=bags.dtype)
            offsets = torch.searchsorted(bags, starts)
        else:
            counts = torch.bincount(bags, minlength=num_bags)
            offsets = counts.cumsum(0) - counts
        return torch.nn.functional.embedding_bag(
            rows, weight, offsets, mode="sum", per_sample_weights=scale
        )
    gathered = weight.index_select(0, rows).float()
    if scale is not None:
        gathered = gathered * scale.unsqueeze(1)
    pooled = torch.zeros(num_bags, weight.shape[1], dtype=torch.float32, device=weight.device)
    return pooled.index_add_(0, bags, gathered)
