"""Learning-rate schedule shared by the dense and the sparse optimizer: linear warm-up,
constant, polynomial decay (the policy of the MLPerf DLRM references).

For the s-th optimizer step (s = 1, 2, ...) both learning rates are `lr * factor(s)`:

    s <= warmup_steps                       factor = s / warmup_steps
    decay_start < s, decay_steps > 0        t = min(s - decay_start, decay_steps) / decay_steps
                                            factor = end_factor + (1 - end_factor) * (1 - t)^power
    otherwise                               factor = 1

so warm-up reaches the full rate at step `warmup_steps`, decay starts after step
`decay_start` and holds `end_factor` from step `decay_start + decay_steps` on. The factor is
a pure function of the step: a resumed run, any world size and any sharding see the same
rates, and nothing needs checkpointing. Changing a rate is a Python float per step, no
device work (the row-update kernels take it as an argument).

The MLPerf DLRM reference on Criteo 1TB (SGD, global batch 55,296) uses
warmup_steps=2750, decay_start=49315, decay_steps=27772, decay_power=2.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybridrec.config import ScheduleConfig


class LRSchedule:
    """factor(step) for the config above; `apply` sets the optimizers' rates for a step."""

    def __init__(self, cfg: ScheduleConfig, dense_lr: float, sparse_lr: float) -> None:
        self.cfg = cfg
        self.dense_lr, self.sparse_lr = dense_lr, sparse_lr

    @property
    def enabled(self) -> bool:
        return self.cfg.warmup_steps > 0 or self.cfg.decay_steps > 0

    def factor(self, step: int) -> float:
        """Learning-rate multiplier of optimizer step `step` (1-based)."""
        c = self.cfg
        if step <= c.warmup_steps:
            return step / c.warmup_steps
        if c.decay_steps > 0 and step > c.decay_start:
            t = min(step - c.decay_start, c.decay_steps) / c.decay_steps
            return c.end_factor + (1.0 - c.end_factor) * (1.0 - t) ** c.decay_power
        return 1.0

    def apply(
        self, step: int, dense_opt: torch.optim.Optimizer, sparse_opts: Iterable[object]
    ) -> tuple[float, float]:
        """Set every dense param group's lr and every row optimizer's `lr` for step `step`;
        returns (dense lr, sparse lr)."""
        f = self.factor(step)
        dense, sparse = self.dense_lr * f, self.sparse_lr * f
        for group in dense_opt.param_groups:
            group["lr"] = dense
        for opt in sparse_opts:
            opt.lr = sparse  # type: ignore[attr-defined]
        return dense, sparse
