"""Row optimizers for embedding tables, applied to the touched rows only.

Each is called by a fused group inside the backward with the deduplicated rows of one step:
`rows` [U] (unique) and their summed gradients `grads` [U, D]. Its state (fp32, stored next
to the weight, moved with it) is declared once, by name, in hybridrec.types
.SPARSE_OPTIMIZER_STATE, which the planner sizes too; element-wise state is [R, D] even for
D = 1. Per group of R rows x D columns:

- sgd              none                         w -= lr * g
- adagrad          sum    [R, D]  per element   s += g^2 ; w -= lr * g / (sqrt(s) + eps)
                   (torch.optim.Adagrad, FBGEMM's EXACT_ADAGRAD: the MLPerf DCNv2 recipe;
                   accumulators start at 0, no lr decay, weight decay off by default)
- rowwise_adagrad  sum    [R]     one per row   s += mean(g^2 over the row)
                                                w -= lr * g / (sqrt(s) + eps)
                   (FBGEMM's row-wise Adagrad: 4 bytes per row instead of 4*D)
- adam             exp_avg, exp_avg_sq [R, D]   lazy Adam: only touched rows' moments decay
                   (torch.optim.SparseAdam's laziness); bias correction uses the group's global
                   step count; eps added to the raw sqrt(v) as SparseAdam does (`eps_form`
                   "sparse_adam", the default), or to the bias-corrected sqrt(v_hat) as
                   torch.optim.Adam and FBGEMM do ("adam": w -= lr * m_hat / (sqrt(v_hat) + eps)).

A class holds its hyperparameters and its maths, once per backend: `torch_maths` (torch ops
on the gathered rows; also the reference, `reference_update`), `triton` (a device function for
hybridrec.kernels.row_update's one launcher) and `native` (its C function in
hybridrec/kernels/native/sparse_rows.c, or None), with `scalars(step)` the numbers the last two
take. hybridrec.kernels.rows chooses the backend (Triton on CUDA, C or torch ops on the CPU);
no optimizer does. Row-wise Adagrad's statistic is the mean of g^2 over the *whole* row
(`needs_full_row_stat`): when a table is split column-wise, the sharded collection computes it
across the column shards and passes it in as `row_sq_mean`, so the update equals the unsharded
one. Weights may be stored in fp16/bf16 (`model.table_dtype`); optimizer state and all maths
stay fp32, and each updated row is rounded once, when it is written back.

Touching only the batch's rows is the standard sparse semantics (torch SparseAdam, FBGEMM);
where every row is touched each step it equals the dense optimizer.

Weight decay (every optimizer: `weight_decay`, `weight_decay_mode`, `table_weight_decay`) is
lazy too: a row decays in the steps that touch it, by the mode's formula (hybridrec.kernels
.decay): "l2" adds wd * w to the gradient, which then goes through the maths (Adagrad's
accumulator and row-wise Adagrad's mean(g^2) included: FBGEMM's L2, torch.optim's
weight_decay); "decoupled" shrinks the row by lr * wd first (AdamW). `table_weight_decay`
({qualified storage table name: decay}) overrides the decay per table; a fused group that
holds tables of different decays passes one decay per row (`weight_decay_for`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict, Unpack

import torch

from hybridrec.kernels._common import device_function, tl
from hybridrec.kernels.rows import reference_update, update_rows
from hybridrec.types import ADAM_EPS_FORMS, SPARSE_OPTIMIZER_STATE, WEIGHT_DECAY_MODES, StateKind

if TYPE_CHECKING:
    from hybridrec.config import SparseOptimConfig

__all__ = ["SPARSE_OPTIMIZERS", "build_sparse_optimizer", "reference_update"]

State = dict[str, torch.Tensor]
_CLASSES: dict[str, type[SparseOptimizer]] = {}


class Decay(TypedDict, total=False):
    """The weight decay's constructor arguments, the same for every sparse optimizer:
    `SparseOptimizer.__init__` takes and checks them, a subclass passes them on (`**decay`)."""

    weight_decay: float
    weight_decay_mode: str
    table_weight_decay: Mapping[str, float] | None


class SparseOptimizer:
    """A row optimizer (hybridrec.sparse.fused.RowOptimizer; hybridrec.kernels.maths.RowMaths).

    A subclass sets `name` (a key of SPARSE_OPTIMIZER_STATE: its state), `triton`, `native`
    and, if its maths reads each row's mean of g^2 over the full width, `needs_full_row_stat`;
    it defines `__init__(self, <its hyperparameters, named as optim.sparse's keys>, **decay)`
    calling `super().__init__(**decay)`, `scalars` and `torch_maths`. Defining the class
    registers it for `build_sparse_optimizer`. Weight decay is this class's alone: its
    arguments and their checks are here (`__init__`), and the backends apply it around the
    maths (hybridrec.kernels.decay).
    """

    name: ClassVar[str]
    needs_full_row_stat: ClassVar[bool] = False  # column shards then share mean(g^2)
    triton: ClassVar[Any]  # (w, g, s0, s1, stat, h0, h1, h2, h3) -> (w, s0, s1)
    native: ClassVar[str | None] = None  # its update in native/sparse_rows.c
    weight_decay: float  # every table's, unless table_weight_decay names it
    weight_decay_mode: str  # one of WEIGHT_DECAY_MODES
    table_weight_decay: Mapping[str, float]  # {qualified storage table name: its decay}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name not in SPARSE_OPTIMIZER_STATE:
            raise TypeError(
                f"{cls.__name__}: declare the state of {cls.name!r} in "
                f"hybridrec.types.SPARSE_OPTIMIZER_STATE"
            )
        _CLASSES[cls.name] = cls

    def __init__(
        self,
        weight_decay: float = 0.0,
        weight_decay_mode: str = "l2",
        table_weight_decay: Mapping[str, float] | None = None,
    ) -> None:
        """Decay every touched row by `weight_decay` (>= 0; 0: none) in `weight_decay_mode`
        (l2 | decoupled), the tables named in `table_weight_decay` (qualified storage table
        names, as hybridrec.parallelize's pins: "users.user") by their own value instead.
        Raises ValueError (one line) for a negative decay or an unknown mode; parallelize
        refuses a table name that its model does not declare."""
        if weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ValueError(
                f"weight_decay_mode={weight_decay_mode!r} is not one of: "
                f"{', '.join(WEIGHT_DECAY_MODES)}"
            )
        named = dict(table_weight_decay or {})
        for key, value in {"weight_decay": weight_decay, **named}.items():
            if not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                what = "weight_decay" if key == "weight_decay" else f"table_weight_decay[{key!r}]"
                raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
        self.weight_decay = float(weight_decay)
        self.weight_decay_mode = weight_decay_mode
        self.table_weight_decay = MappingProxyType({k: float(v) for k, v in named.items()})

    @classmethod
    def parameters(cls) -> tuple[str, ...]:
        """The constructor's parameter names (the optim.sparse keys it takes): the class's
        own, then, when it takes `**decay`, the weight decay's (`Decay`)."""
        own = inspect.signature(cls).parameters.values()
        names = [p.name for p in own if p.kind is not p.VAR_KEYWORD]
        if any(p.kind is p.VAR_KEYWORD for p in own):
            names += list(Decay.__annotations__)
        return tuple(names)

    def weight_decay_for(self, table: str) -> float:
        """The decay of storage table `table` (its qualified name)."""
        return self.table_weight_decay.get(table, self.weight_decay)

    def state_spec(self) -> dict[str, StateKind]:
        """Optimizer state: name -> its kind, one fp32 per row ([R]) or per element ([R, D])."""
        return dict(SPARSE_OPTIMIZER_STATE[self.name])

    def scalars(self, step: int) -> tuple[float, ...]:
        """The hyperparameters of step `step` as the Triton and C maths take them."""
        raise NotImplementedError

    def torch_maths(
        self, grads: torch.Tensor, state: State, step: int, row_sq_mean: torch.Tensor | None
    ) -> tuple[torch.Tensor, float, State]:
        """(delta [U, D], scale, new state rows): w -= scale * delta (hybridrec.kernels.rows)."""
        raise NotImplementedError

    def update(
        self,
        weight: torch.Tensor,
        state: State,
        rows: torch.Tensor,
        grads: torch.Tensor,
        step: int,
        row_sq_mean: torch.Tensor | None = None,
        count: torch.Tensor | None = None,
        weight_decay: float | torch.Tensor | None = None,
    ) -> None:
        """One step on weight[rows] and its state (hybridrec.kernels.rows.update_rows);
        `weight_decay`: None (self.weight_decay), a float, or [U] fp32, one per row."""
        update_rows(self, weight, state, rows, grads, step, row_sq_mean, count, weight_decay)

    def __repr__(self) -> str:
        values = {p: getattr(self, p) for p in self.parameters()}
        shown = {p: dict(v) if isinstance(v, Mapping) else v for p, v in values.items()}
        return f"{type(self).__name__}({', '.join(f'{p}={v!r}' for p, v in shown.items())})"


@device_function
def _sgd_maths(w, g, s0, s1, stat, lr, h1, h2, h3):  # noqa: ANN001, ANN202
    return tl.fma(g, -lr, w), s0, s1  # torch's index_add_(alpha=-lr) / sub_(alpha=lr)


class SparseSGD(SparseOptimizer):
    name = "sgd"
    triton = _sgd_maths
    native = "hr_sgd"

    def __init__(
        self,
        lr: float,
        **decay: Unpack[Decay],
    ) -> None:
        super().__init__(**decay)
        self.lr = lr

    def scalars(self, step: int) -> tuple[float, ...]:
        return (self.lr,)

    def torch_maths(self, grads, state, step, row_sq_mean):  # noqa: ANN001, ANN201
        return grads, self.lr, {}


@device_function
def _adagrad_maths(w, g, acc, s1, stat, lr, eps, h2, h3):  # noqa: ANN001, ANN202
    s = tl.fma(g, g, acc)  # torch's addcmul_: one rounding
    return tl.fma(tl.div_rn(g, tl.sqrt_rn(s) + eps), -lr, w), s, s1


class SparseAdagrad(SparseOptimizer):
    name = "adagrad"
    triton = _adagrad_maths
    native = "hr_adagrad"

    def __init__(
        self,
        lr: float,
        eps: float = 1e-10,  # torch.optim.Adagrad's
        **decay: Unpack[Decay],
    ) -> None:
        super().__init__(**decay)
        self.lr, self.eps = lr, eps

    def scalars(self, step: int) -> tuple[float, ...]:
        return (self.lr, self.eps)

    def torch_maths(self, grads, state, step, row_sq_mean):  # noqa: ANN001, ANN201
        new_sum = state["sum"].addcmul_(grads, grads)  # as torch.optim.Adagrad
        return grads / (new_sum.sqrt() + self.eps), self.lr, {"sum": new_sum}


@device_function
def _rowwise_adagrad_maths(w, g, acc, s1, stat, lr, eps, h2, h3):  # noqa: ANN001, ANN202
    s = acc + stat
    return tl.fma(tl.div_rn(g, tl.sqrt_rn(s) + eps), -lr, w), s, s1


class RowWiseAdagrad(SparseOptimizer):
    name = "rowwise_adagrad"
    needs_full_row_stat = True  # column shards must share mean(g^2) over the full row
    triton = _rowwise_adagrad_maths
    native = "hr_rowwise_adagrad"

    def __init__(
        self,
        lr: float,
        eps: float = 1e-8,
        **decay: Unpack[Decay],
    ) -> None:
        super().__init__(**decay)
        self.lr, self.eps = lr, eps

    def scalars(self, step: int) -> tuple[float, ...]:
        return (self.lr, self.eps)

    def torch_maths(self, grads, state, step, row_sq_mean):  # noqa: ANN001, ANN201
        new_sum = state["sum"] + row_sq_mean
        return grads / (new_sum.sqrt() + self.eps).unsqueeze(1), self.lr, {"sum": new_sum}


@device_function
def _adam_maths(w, g, m, v, stat, step_size, c1, c2, eps):  # noqa: ANN001, ANN202
    m = (g - m) * c1 + m
    v = (g * g - v) * c2 + v
    return tl.fma(tl.div_rn(m, tl.sqrt_rn(v) + eps), -step_size, w), m, v


class SparseAdam(SparseOptimizer):
    name = "adam"
    triton = _adam_maths
    native = "hr_adam"

    def __init__(
        self,
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        eps_form: str = "sparse_adam",
        **decay: Unpack[Decay],
    ) -> None:
        super().__init__(**decay)
        if eps_form not in ADAM_EPS_FORMS:
            raise ValueError(f"eps_form must be one of {ADAM_EPS_FORMS}, not {eps_form!r}")
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps
        self.eps_form = eps_form

    def step_size(self, step: int) -> float:
        """lr with Adam's bias corrections at step `step` (the group's global count)."""
        return self.lr * math.sqrt(1 - self.beta2**step) / (1 - self.beta1**step)

    def step_eps(self, step: int) -> float:
        """The eps added to the raw sqrt(v) at step `step`. With the bias corrections folded
        into step_size, torch.optim.Adam's m_hat / (sqrt(v_hat) + eps) is
        m / (sqrt(v) + eps * sqrt(1 - beta2^step)) times step_size: one maths serves both
        forms (every backend), only this scalar differs."""
        if self.eps_form == "sparse_adam":
            return self.eps
        return self.eps * math.sqrt(1 - self.beta2**step)

    def scalars(self, step: int) -> tuple[float, ...]:
        return (self.step_size(step), 1 - self.beta1, 1 - self.beta2, self.step_eps(step))

    def torch_maths(self, grads, state, step, row_sq_mean):  # noqa: ANN001, ANN201
        m_old, v_old = state["exp_avg"], state["exp_avg_sq"]
        m = (grads - m_old).mul_(1 - self.beta1).add_(m_old)
        v = (grads.pow(2) - v_old).mul_(1 - self.beta2).add_(v_old)
        delta = m / (v.sqrt() + self.step_eps(step))
        return delta, self.step_size(step), {"exp_avg": m, "exp_avg_sq": v}


_missing = set(SPARSE_OPTIMIZER_STATE) - set(_CLASSES)
if _missing:  # a name whose state is declared needs its class (the config offers it)
    raise ImportError(f"no row optimizer class for {sorted(_missing)} in {__name__}")
SPARSE_OPTIMIZERS = tuple(SPARSE_OPTIMIZER_STATE)  # optim.sparse.name's choices


def build_sparse_optimizer(cfg: SparseOptimConfig) -> SparseOptimizer:
    """The row optimizer named by `optim.sparse.name`, with the config's values for its
    constructor's parameters (lr, eps, beta1, beta2, weight_decay, weight_decay_mode,
    table_weight_decay, eps_form: each class takes the ones it has)."""
    if cfg.name not in _CLASSES:
        raise ValueError(
            f"optim.sparse.name={cfg.name!r} is not one of: {', '.join(SPARSE_OPTIMIZERS)}"
        )
    cls = _CLASSES[cfg.name]
    try:
        return cls(**{p: getattr(cfg, p) for p in cls.parameters()})
    except ValueError as e:  # the decay's arguments, named as the config's keys
        raise ValueError(f"optim.sparse.{e}") from None
