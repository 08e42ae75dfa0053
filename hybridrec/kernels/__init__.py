"""Embedding kernels: Triton kernels and the torch ops they replace, one module per concern.

- dispatch: which path runs (`train.kernels`: set_kernels, use_kernels, available)
- lookup: pooled lookup (`pool`: the Triton kernel, or torch's embedding_bag / index_add_)
- segment: gradient dedupe per distinct row (`dedupe`, the sync-free `segment_grads_padded`)
- rows: one row optimizer step on the touched rows, on the backend chosen here once for
  every optimizer (Triton, the C kernels, or torch ops around the optimizer's maths)
- row_update: the one Triton launcher of row updates (a tile kernel for element-wise maths,
  a per-row one for maths over the full row), taking each optimizer's maths as a constexpr
- cpu_rows: the torch path's dedupe (one sort, index_add_ in id order) and row write-back
  (`apply_delta`)
- native: the CPU's C kernels (hashing dedupe, in-place row updates), built once per machine
- host_copy: row copies between pinned host memory and the device (UVA kernel)
- pages: transparent huge pages for large CPU tables (rows read at random)
- _common: the triton import, per-mode jitting, argument checks, the one rounding to bf16/fp16

Imports nothing else of hybridrec: embedding storage (hybridrec.sparse) and the row
optimizers (hybridrec.optim) both build on it.
"""
