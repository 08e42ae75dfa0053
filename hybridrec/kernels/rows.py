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
On the CPU the native sqrt is correctly rounded (as the Triton kernels'), which torch's CPU
sqrt is not always: that is the backends' only difference (tests/unit/test_native_rows.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridrec.kernels import native, row_update
from hybridrec.kernels._common import round_to
from hybridrec.kernels.cpu_rows import apply_delta, copy_rows, gather_rows
from hybridrec.kernels.dispatch import available
from hybridrec.kernels.maths import RowMaths, State


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


def _triton(opt, weight, state, rows, grads, step, row_sq_mean, count) -> None:  # noqa: ANN001
    row_update.update(opt, weight, state, rows, grads, step, row_sq_mean, count=count)


def _native(opt, weight, state, rows, grads, step, row_sq_mean, count) -> None:  # noqa: ANN001
    rows, grads, row_sq_mean = _real(count, rows, grads, row_sq_mean)
    stat = _row_stat(opt, grads, row_sq_mean) if opt.needs_full_row_stat else None
    states = [state[n] for n in opt.state_spec()]
    native.row_update(opt.native, weight, states, rows, grads, stat, opt.scalars(step))


def _torch(opt, weight, state, rows, grads, step, row_sq_mean, count) -> None:  # noqa: ANN001
    rows, grads, row_sq_mean = _real(count, rows, grads, row_sq_mean)
    old = {n: gather_rows(state[n], rows) for n in opt.state_spec()}
    delta, scale, new = opt.torch_maths(grads, old, step, _row_stat(opt, grads, row_sq_mean))
    for n, rows_n in new.items():
        copy_rows(state[n], rows, rows_n)
    apply_delta(weight, rows, delta, scale)


BACKENDS: dict[str, Callable[..., None]] = {"triton": _triton, "native": _native, "torch": _torch}


def backend(
    opt: RowMaths,
    weight: torch.Tensor,
    state: State,
    rows: torch.Tensor,
    grads: torch.Tensor,
    row_sq_mean: torch.Tensor | None = None,
) -> str:
    """The backend these tensors take: "triton", "native" or "torch" (module docstring)."""
    if available(weight):
        return "triton"
    stat = row_sq_mean if opt.needs_full_row_stat else None
    if opt.native is not None and native.usable(
        rows, grads, stat, inplace=(weight, *state.values())
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
) -> None:
    """One step of `opt` at optimizer step `step` >= 1 on weight[rows] (rows [U], unique)
    with grads [U, D], and on its state rows, in place, on `backend`'s choice.

    `row_sq_mean` [U], when given, is mean(g^2) over each row's full width (a column shard
    only sees part of the row); maths with needs_full_row_stat use it, others ignore it.
    `count` ([1] int64 on the device), when given, says only the first count rows are real
    (the rest is padding from Triton's sync-free dedupe)."""
    run = BACKENDS[backend(opt, weight, state, rows, grads, row_sq_mean)]
    run(opt, weight, state, rows, grads, step, row_sq_mean, count)


def reference_update(
    opt: RowMaths,
    weight: torch.Tensor,
    state: State,
    rows: torch.Tensor,
    grads: torch.Tensor,
    step: int,
    row_sq_mean: torch.Tensor | None = None,
) -> None:
    """`update_rows` as the former torch path: index_select / index_copy_ per state tensor and
    index_add_ into an fp32 weight (else its rows rounded once), around the same torch_maths.
    The reference the tests and benchmarks.sparse_update compare the backends with."""
    old = {n: state[n].index_select(0, rows) for n in opt.state_spec()}
    delta, scale, new = opt.torch_maths(grads, old, step, _row_stat(opt, grads, row_sq_mean))
    for n, rows_n in new.items():
        state[n].index_copy_(0, rows, rows_n)
    if weight.dtype == torch.float32:
        weight.index_add_(0, rows, delta, alpha=-scale)
    else:
        new_rows = weight.index_select(0, rows).float().sub_(delta, alpha=scale)
        weight.index_copy_(0, rows, round_to(new_rows, weight.dtype))
