"""What the row-update backends need from a sparse optimizer: the `RowMaths` protocol.

Its own module, so that the backend chooser (hybridrec.kernels.rows) and the Triton launcher
(hybridrec.kernels.row_update) both name it without importing each other.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hybridrec.types import StateKind

State = dict[str, torch.Tensor]  # state name -> its rows ([U] or [U, D])


class RowMaths(Protocol):
    """What the backends need from a row optimizer (implemented in hybridrec.optim.sparse).

    `state_spec()`: state name -> kind, in the order the kernels take them. `scalars(step)`:
    the hyperparameters of step `step` as the Triton and C maths take them (h0, h1, ...).
    `torch_maths(grads, state, step, row_sq_mean)` -> (delta, scale, new state): the step on
    U gathered rows: grads [U, D], state name -> its rows ([U] or [U, D], fresh copies it may
    change), row_sq_mean [U] where needs_full_row_stat; the weight moves by -scale * delta
    [U, D] and the state becomes the returned rows. `triton`: the same maths as a device
    function (hybridrec.kernels.row_update); `native`: the name of its C function in
    native/sparse_rows.c, or None (then the CPU takes torch_maths). Weight decay is the
    backends' (hybridrec.kernels.decay), from `weight_decay`, `weight_decay_mode` and `lr`.
    """

    name: str
    needs_full_row_stat: bool
    triton: Any
    native: str | None
    lr: float  # read by decoupled weight decay
    weight_decay: float  # for rows the caller gives no decay of their own
    weight_decay_mode: str  # one of hybridrec.types.WEIGHT_DECAY_MODES

    def state_spec(self) -> dict[str, StateKind]: ...

    def scalars(self, step: int) -> tuple[float, ...]: ...

    def torch_maths(
        self,
        grads: torch.Tensor,
        state: State,
        step: int,
        row_sq_mean: torch.Tensor | None,
    ) -> tuple[torch.Tensor, float, State]: ...
