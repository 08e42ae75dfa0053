"""One row optimizer step on the touched rows, on the backend the tensors take.

`update_rows(opt, weight, state, rows, grads, step, row_sq_mean, count)` is every sparse
optimizer's `update`: `backend` picks, in this one place, from the tensors' kind and the
process's kernel mode (hybridrec.kernels.dispatch), one of
- "triton": CUDA tensors, or CPU ones under TRITON_INTERPRET=1 (`dispatch.available`):
  hybridrec.kernels.row_update.update, the optimizer's `triton` maths in one kernel, reading
  a padded input's `count` on the device (no host sync);
- "native": CPU fp32 contiguous tensors, where the C library loads and the optimizer names
  a C kernel (`native`): hybridrec.kernels.native.row_update, one pass over each row;
- "torch": everything else: each touched row of the weight and state is gathered, the
  optimizer's `torch_maths` runs on them, and they are written back whole
  (hybridrec.kernels.cpu_rows).
`reference_update` is the former index-op path with the same maths (index_select /
index_copy_ / index_add_ per tensor): what tests and benchmarks compare the others with.

The optimizer (`RowMaths`) holds only its hyperparameters, its state (hybridrec.types
.SPARSE_OPTIMIZER_STATE) and its maths, once per backend; nothing here names an optimizer.

Weight decay (hybridrec.kernels.decay: L2 or decoupled, one decay for all rows or one per
row, `weight_decay=`) is applied here, around any optimizer's maths, by the same fp32
operations on every backend; a decay of 0 takes the undecayed path, the same bits as before.
On the CPU the native sqrt is correctly rounded (as the Triton kernels'), which torch's CPU
sqrt is not always: that is the backends' only difference (tests/unit/test_native_rows.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridrec.kernels import native, row_update
from hybridrec.kernels._common import round_to
from hybridrec.kernels.cpu_rows import apply_delta, copy_rows, gather_rows
from hybridrec.kernels.decay import (
    DECOUPLED,
    L2,
    NO_DECAY,
    WeightDecay,
    decay_of,
    decayed_rows,
    l2_grads,
)
from hybridrec.kernels.dispatch import available
from hybridrec.kernels.maths import RowMaths, State


def seen_grads(
    opt: RowMaths,
    weight: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    weight_decay: WeightDecay = None,
) -> torch.Tensor:
    """The gradient [U, D] fp32 opt's maths see for weight[rows]: grads, plus wd * w under L2
    decay. A row-wise statistic is of these (hybridrec.sparse.exchange.row_stats, the fused
    group's full-row statistics): FBGEMM's row-wise Adagrad adds the L2 term first too."""
    decay = decay_of(opt, weight_decay)
    if decay.kind != L2:
        return grads
    return l2_grads(grads, gather_rows(weight, rows).float(), decay)


def _real(count: torch.Tensor | None, *tensors: torch.Tensor | None) -> tuple:
    """The first `count` entries of padded inputs (host paths: reads count, a host sync)."""
    if count is None:
        return tensors
    n = int(count)
    return tuple(None if t is None else t[:n] for t in tensors)


def _row_stat(opt: RowMaths, grads: torch.Tensor, row_sq_mean: torch.Tensor | None):  # noqa: ANN202
    """The mean of g^2 over each row, where the maths reads it and no full-row one is given."""
    if opt.needs_full_row_stat and row_sq_mean is None:
        return grads.pow(2).mean(dim=1)
    return row_sq_mean


def _triton(opt, weight, state, rows, grads, step, row_sq_mean, count, decay) -> None:  # noqa: ANN001
    row_update.update(opt, weight, state, rows, grads, step, row_sq_mean, count=count, decay=decay)


def _native(opt, weight, state, rows, grads, step, row_sq_mean, count, decay) -> None:  # noqa: ANN001
    rows, grads, row_sq_mean = _real(count, rows, grads, row_sq_mean)
    if count is not None:
        decay = decay.cut(rows.numel())
    stat = None
    if opt.needs_full_row_stat:  # the C maths take mean(g^2) of the gradient they see
        seen = grads
        if row_sq_mean is None and decay.kind == L2:
            seen = l2_grads(grads, weight.index_select(0, rows), decay)
        stat = _row_stat(opt, seen, row_sq_mean)
    states = [state[n] for n in opt.state_spec()]
    native.row_update(
        opt.native, weight, states, rows, grads, stat, opt.scalars(step),
        (decay.kind, decay.value, decay.lr, decay.rows),
    )  # fmt: skip


def _torch(opt, weight, state, rows, grads, step, row_sq_mean, count, decay) -> None:  # noqa: ANN001
    rows, grads, row_sq_mean = _real(count, rows, grads, row_sq_mean)
    if count is not None:
        decay = decay.cut(rows.numel())
    w_rows = gather_rows(weight, rows).float() if decay.kind != NO_DECAY else None
    if decay.kind == L2:
        grads = l2_grads(grads, w_rows, decay)
    old = {n: gather_rows(state[n], rows) for n in opt.state_spec()}
    delta, scale, new = opt.torch_maths(grads, old, step, _row_stat(opt, grads, row_sq_mean))
    for n, rows_n in new.items():
        copy_rows(state[n], rows, rows_n)
    if decay.kind == DECOUPLED:  # the shrunk row takes the step (the add kernel's rounding)
        new_w = decayed_rows(w_rows, decay).sub_(delta, alpha=scale)
        copy_rows(weight, rows, round_to(new_w, weight.dtype))
    else:
        apply_delta(weight, rows, delta, scale)


BACKENDS: dict[str, Callable[..., None]] = {"triton": _triton, "native": _native, "torch": _torch}


def backend(
    opt: RowMaths,
    weight: torch.Tensor,
    state: State,
    rows: torch.Tensor,
    grads: torch.Tensor,
    row_sq_mean: torch.Tensor | None = None,
    weight_decay: WeightDecay = None,
) -> str:
    """The backend these tensors take: "triton", "native" or "torch" (module docstring)."""
    if available(weight):
        return "triton"
    stat = row_sq_mean if opt.needs_full_row_stat else None
    wd = weight_decay if isinstance(weight_decay, torch.Tensor) else None
    if opt.native is not None and native.usable(
        rows, grads, stat, wd, inplace=(weight, *state.values())
    ):
        return "native"
    return "torch"


def update_rows(
    opt: RowMaths,
    weight: torch.Tensor,
    state: State,
    rows: torch.Tensor,
    grads: torch.Tensor,
    step: int,
    row_sq_mean: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    weight_decay: WeightDecay = None,
) -> None:
    """One step of `opt` at optimizer step `step` >= 1 on weight[rows] (rows [U], unique)
    with grads [U, D], and on its state rows, in place, on `backend`'s choice.

    `row_sq_mean` [U], when given, is mean(g^2) over each row's full width (a column shard
    only sees part of the row) of the gradient the maths see (with L2 decay: g + wd * w,
    `seen_grads`); maths with needs_full_row_stat use it, others ignore it.
    `count` ([1] int64 on the device), when given, says only the first count rows are real
    (the rest is padding from Triton's sync-free dedupe). `weight_decay`: None (opt's
    weight_decay), a float, or [U] fp32 per row (`decay_of`), in opt's weight_decay_mode."""
    decay = decay_of(opt, weight_decay)
    run = BACKENDS[backend(opt, weight, state, rows, grads, row_sq_mean, decay.rows)]
    run(opt, weight, state, rows, grads, step, row_sq_mean, count, decay)


def reference_update(
    opt: RowMaths,
    weight: torch.Tensor,
    state: State,
    rows: torch.Tensor,
    grads: torch.Tensor,
    step: int,
    row_sq_mean: torch.Tensor | None = None,
    weight_decay: WeightDecay = None,
) -> None:
    """`update_rows` as the former torch path: index_select / index_copy_ per state tensor and
    index_add_ into an fp32 weight (else its rows rounded once), around the same torch_maths.
    The reference the tests and benchmarks.sparse_update compare the backends with."""
    decay = decay_of(opt, weight_decay)
    w_rows = weight.index_select(0, rows).float() if decay.kind != NO_DECAY else None
    if decay.kind == L2:
        grads = l2_grads(grads, w_rows, decay)
    old = {n: state[n].index_select(0, rows) for n in opt.state_spec()}
    delta, scale, new = opt.torch_maths(grads, old, step, _row_stat(opt, grads, row_sq_mean))
    for n, rows_n in new.items():
        state[n].index_copy_(0, rows, rows_n)
    if decay.kind == DECOUPLED:
        new_rows = decayed_rows(w_rows, decay).sub_(delta, alpha=scale)
        weight.index_copy_(0, rows, round_to(new_rows, weight.dtype))
    elif weight.dtype == torch.float32:
        weight.index_add_(0, rows, delta, alpha=-scale)
    else:
        new_rows = weight.index_select(0, rows).float().sub_(delta, alpha=scale)
        weight.index_copy_(0, rows, round_to(new_rows, weight.dtype))
