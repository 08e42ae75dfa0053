"""NaN or inf losses, caught without a host sync per step.

A device-side record keeps the first bad step; it is read (`check`) at the next log or
checkpoint, which sync anyway (train.nonfinite=error). The `skip` policy must decide before
the backward, which applies the sparse update, so it reads the loss every step
(`all_finite`, a collective) and the step's update is dropped on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridrec.distributed.comm import all_reduce
from hybridrec.distributed.env import DistEnv


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf; the message names the step."""


class NonFiniteWatch:
    """The first optimizer step whose loss was not finite, over all ranks."""

    def __init__(self, env: DistEnv, inputs_checked: bool = True) -> None:
        self.env = env
        # with train.check_ids, NaN or inf inputs raise first (hybridrec.train.dense_check)
        self.inputs_checked = inputs_checked
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=env.device)

    def note(self, loss: torch.Tensor, step: int) -> None:
        """Remember `step` if `loss` is not finite and no earlier step was (no sync)."""
        bad = ~torch.isfinite(loss.detach())
        self._first_bad = torch.where(bad & (self._first_bad < 0), step, self._first_bad)

    def all_finite(self, loss: torch.Tensor) -> bool:
        """Whether the loss is finite on every rank (a collective and a sync)."""
        ok = torch.isfinite(loss.detach()).to(torch.int64)
        all_reduce(ok, self.env.group, dist.ReduceOp.MIN, "loss_finite")
        return bool(ok.item())

    def check(self) -> None:
        """Raise if any step so far had a NaN or inf loss, naming the first such step."""
        first = self._first_bad.clone()
        all_reduce(first, self.env.group, dist.ReduceOp.MAX, "nonfinite_check")
        if int(first) >= 0:
            if self.inputs_checked:
                why, data = " (its dense inputs were finite)", ""
            else:
                why, data = "", ", check the data (train.check_ids=true checks it)"
            raise NonFiniteLossError(
                f"loss became NaN or inf at step {int(first)}{why}; lower the learning rates "
                f"(optim.dense.lr, optim.sparse.lr){data}, or set train.nonfinite=skip to drop "
                "such steps"
            )
