"""Row optimizers for embedding tables, applied to the touched rows only.

Each is called by a fused group inside the backward with the deduplicated rows of one step:
`rows` [U] (unique, sorted) and their summed gradients `grads` [U, D]. State layout per
group of R rows x D columns (fp32, stored next to the weight, moved with it; `state_spec`
names each state's StateKind, so element-wise state is [R, D] even for D = 1):

- sgd              none                         w -= lr * g
- adagrad          sum    [R, D]  per element   s += g^2 ; w -= lr * g / (sqrt(s) + eps)
                   (torch.optim.Adagrad, FBGEMM's EXACT_ADAGRAD: the MLPerf DCNv2 recipe;
                   accumulators start at 0, no lr decay, no weight decay)
- rowwise_adagrad  sum    [R]     one per row   s += mean(g^2 over the row)
                                                w -= lr * g / (sqrt(s) + eps)
                   (FBGEMM's row-wise Adagrad: 4 bytes per row instead of 4*D)
- adam             exp_avg, exp_avg_sq [R, D]   lazy Adam, as torch.optim.SparseAdam: only touched
                   rows' moments decay; bias correction uses the group's global step count.

Row-wise Adagrad's statistic is the mean of g^2 over the *whole* row. When a table is split
column-wise, the sharded collection computes it across the column shards and passes it in as
`row_sq_mean`, so the update equals the unsharded one.

Weights may be stored in fp16/bf16 (`model.table_dtype`); optimizer state and all optimizer
math stay fp32, and each updated row is rounded once, when it is written back (`apply_delta`).
On the CPU, fp32 tables take the native kernels (hybridrec.kernels.native: one pass over each
touched row, in C); elsewhere the torch path reads each touched row of the weight and state once
and writes it back whole (hybridrec.kernels.cpu_rows); `reference_update` is the former
index_add_ path, same math. The native sqrt is correctly rounded (as the Triton kernels'), which
torch's CPU sqrt is not always: that is their only difference (tests/unit/test_native_rows.py).

On CUDA (and under TRITON_INTERPRET=1) each update is one Triton kernel with the same math
(hybridrec.kernels.row_update); `train.kernels=torch` keeps the torch ops.

Touching only the batch's rows is the standard sparse semantics (torch SparseAdam, FBGEMM);
where every row is touched each step it equals the dense optimizer.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from hybridrec.kernels import native
from hybridrec.kernels._common import round_to
from hybridrec.kernels.cpu_rows import apply_delta, copy_rows, gather_rows
from hybridrec.kernels.dispatch import available
from hybridrec.kernels.row_update import (
    adagrad_update,
    adam_update,
    rowwise_adagrad_update,
    sgd_update,
)
from hybridrec.types import StateKind

if TYPE_CHECKING:
    from hybridrec.config import SparseOptimConfig


def _real(count: torch.Tensor | None, *tensors: torch.Tensor | None) -> tuple:
    """The first `count` entries of padded inputs (torch path: reads count, a host sync)."""
    if count is None:
        return tensors
    n = int(count)
    return tuple(None if t is None else t[:n] for t in tensors)


class SparseSGD:
    name = "sgd"

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def state_spec(self) -> dict[str, StateKind]:
        return {}

    def update(self, weight, state, rows, grads, step, row_sq_mean=None, count=None) -> None:  # noqa: ANN001
        if available(weight):
            sgd_update(weight, rows, grads, self.lr, count=count)
            return
        rows, grads = _real(count, rows, grads)
        if native.usable(rows, grads, inplace=(weight,)):
            native.sgd(weight, rows, grads, self.lr)
            return
        apply_delta(weight, rows, grads, self.lr)


class SparseAdagrad:
    name = "adagrad"

    def __init__(self, lr: float, eps: float = 1e-10) -> None:  # eps: torch.optim.Adagrad's
        self.lr, self.eps = lr, eps

    def state_spec(self) -> dict[str, StateKind]:
        return {"sum": StateKind.ELEMENT}

    def update(self, weight, state, rows, grads, step, row_sq_mean=None, count=None) -> None:  # noqa: ANN001
        acc = state["sum"]
        if available(weight):
            adagrad_update(weight, acc, rows, grads, self.lr, self.eps, count=count)
            return
        rows, grads = _real(count, rows, grads)
        if native.usable(rows, grads, inplace=(weight, acc)):
            native.adagrad(weight, acc, rows, grads, self.lr, self.eps)
            return
        new_sum = gather_rows(acc, rows).addcmul_(grads, grads)  # as torch.optim.Adagrad
        copy_rows(acc, rows, new_sum)
        delta = grads / (new_sum.sqrt() + self.eps)
        apply_delta(weight, rows, delta, self.lr)


class RowWiseAdagrad:
    name = "rowwise_adagrad"
    needs_full_row_stat = True  # column shards must share mean(g^2) over the full row

    def __init__(self, lr: float, eps: float = 1e-8) -> None:
        self.lr, self.eps = lr, eps

    def state_spec(self) -> dict[str, StateKind]:
        return {"sum": StateKind.ROW}

    def update(self, weight, state, rows, grads, step, row_sq_mean=None, count=None) -> None:  # noqa: ANN001
        acc = state["sum"]
        if available(weight):
            rowwise_adagrad_update(
                weight, acc, rows, grads, self.lr, self.eps, row_sq_mean, count=count
            )
            return
        rows, grads, row_sq_mean = _real(count, rows, grads, row_sq_mean)
        if row_sq_mean is None:
            row_sq_mean = grads.pow(2).mean(dim=1)
        if native.usable(rows, grads, row_sq_mean, inplace=(weight, acc)):
            native.rowwise_adagrad(weight, acc, rows, grads, row_sq_mean, self.lr, self.eps)
            return
        new_sum = acc.index_select(0, rows) + row_sq_mean
        acc.index_copy_(0, rows, new_sum)
        delta = grads / (new_sum.sqrt() + self.eps).unsqueeze(1)
        apply_delta(weight, rows, delta, self.lr)


class SparseAdam:
    name = "adam"

    def __init__(self, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps

    def state_spec(self) -> dict[str, StateKind]:
        return {"exp_avg": StateKind.ELEMENT, "exp_avg_sq": StateKind.ELEMENT}

    def update(self, weight, state, rows, grads, step, row_sq_mean=None, count=None) -> None:  # noqa: ANN001
        bias1 = 1 - self.beta1**step
        bias2 = 1 - self.beta2**step
        step_size = self.lr * math.sqrt(bias2) / bias1
        if available(weight):
            m, v = state["exp_avg"], state["exp_avg_sq"]
            args = (self.beta1, self.beta2, self.eps)
            adam_update(weight, m, v, rows, grads, step_size, *args, count=count)
            return
        rows, grads = _real(count, rows, grads)
        m_, v_ = state["exp_avg"], state["exp_avg_sq"]
        if native.usable(rows, grads, inplace=(weight, m_, v_)):
            native.adam(weight, m_, v_, rows, grads, step_size, self.beta1, self.beta2, self.eps)
            return
        m_old = gather_rows(state["exp_avg"], rows)
        v_old = gather_rows(state["exp_avg_sq"], rows)
        m = (grads - m_old).mul_(1 - self.beta1).add_(m_old)
        v = (grads.pow(2) - v_old).mul_(1 - self.beta2).add_(v_old)
        copy_rows(state["exp_avg"], rows, m)
        copy_rows(state["exp_avg_sq"], rows, v)
        delta = m / (v.sqrt() + self.eps)
        apply_delta(weight, rows, delta, step_size)


def reference_update(opt, weight, state, rows, grads, step, row_sq_mean=None) -> None:  # noqa: ANN001
    """The former torch path of `opt.update` (index_add_ / index_copy_ per tensor, elementwise):
    the same math as the optimizers' torch path, kept as the reference the tests and
    benchmarks.sparse_update compare them with."""

    def write_back(delta: torch.Tensor, scale: float) -> None:
        if weight.dtype == torch.float32:
            weight.index_add_(0, rows, delta, alpha=-scale)
        else:
            new = weight.index_select(0, rows).float().sub_(delta, alpha=scale)
            weight.index_copy_(0, rows, round_to(new, weight.dtype))

    if opt.name == "sgd":
        write_back(grads, opt.lr)
    elif opt.name == "adagrad":
        acc = state["sum"].view(weight.shape)
        new_sum = acc.index_select(0, rows).addcmul_(grads, grads)
        acc.index_copy_(0, rows, new_sum)
        write_back(grads / (new_sum.sqrt() + opt.eps), opt.lr)
    elif opt.name == "rowwise_adagrad":
        if row_sq_mean is None:
            row_sq_mean = grads.pow(2).mean(dim=1)
        new_sum = state["sum"].index_select(0, rows) + row_sq_mean
        state["sum"].index_copy_(0, rows, new_sum)
        write_back(grads / (new_sum.sqrt() + opt.eps).unsqueeze(1), opt.lr)
    else:
        step_size = opt.lr * math.sqrt(1 - opt.beta2**step) / (1 - opt.beta1**step)
        m_old = state["exp_avg"].index_select(0, rows)
        v_old = state["exp_avg_sq"].index_select(0, rows)
        m = (grads - m_old).mul_(1 - opt.beta1).add_(m_old)
        v = (grads.pow(2) - v_old).mul_(1 - opt.beta2).add_(v_old)
        state["exp_avg"].index_copy_(0, rows, m)
        state["exp_avg_sq"].index_copy_(0, rows, v)
        write_back(m / (v.sqrt() + opt.eps), step_size)


RowOptimizerT = SparseSGD | SparseAdagrad | RowWiseAdagrad | SparseAdam


# optim.sparse.name -> the row optimizer it builds; the config's choices are these names
_BUILDERS = {
    "sgd": lambda c: SparseSGD(c.lr),
    "rowwise_adagrad": lambda c: RowWiseAdagrad(c.lr, c.eps),
    "adam": lambda c: SparseAdam(c.lr, c.beta1, c.beta2, c.eps),
    "adagrad": lambda c: SparseAdagrad(c.lr, c.eps),
}
SPARSE_OPTIMIZERS = tuple(_BUILDERS)


def build_sparse_optimizer(cfg: SparseOptimConfig) -> RowOptimizerT:
    """The row optimizer named by `optim.sparse.name`."""
    if cfg.name not in _BUILDERS:
        raise ValueError(
            f"optim.sparse.name={cfg.name!r} is not one of: {', '.join(SPARSE_OPTIMIZERS)}"
        )
    return _BUILDERS[cfg.name](cfg)
