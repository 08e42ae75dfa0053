"""What the model learns from its labels (`model.task`): the loss, and what a prediction is.

The model's raw output is one float per sample, [B] fp32, for every task:
- binary: labels in {0, 1}; loss = mean binary cross-entropy with logits; a prediction is
  sigmoid(output), a probability.
- regression: float labels; loss = mean squared error of the raw output; a prediction is the
  raw output itself.
Both losses are means over the batch: the gradient-scaling convention (docs/architecture.md:
each rank's loss is a mean over its slice, the sharded exchanges scale by 1/W) builds on it.
Everything task-dependent on the model side is chosen here, by `task_of(cfg.task)`; the
metrics a task reports are chosen in hybridrec.train.metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybridrec.types import TASKS


def bce_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of logits [B] against labels [B] in {0, 1}."""
    return nn.functional.binary_cross_entropy_with_logits(outputs.float(), labels.float())


def mse_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean squared error of raw outputs [B] against float labels [B]."""
    return nn.functional.mse_loss(outputs.float(), labels.float())


def _identity(outputs: torch.Tensor) -> torch.Tensor:
    return outputs


@dataclass(frozen=True)
class Task:
    """A task's loss (outputs [B], labels [B] -> mean over B) and prediction (outputs -> [B])."""

    name: str
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    predict: Callable[[torch.Tensor], torch.Tensor]


_TASKS = {
    "binary": Task("binary", bce_loss, torch.sigmoid),
    "regression": Task("regression", mse_loss, _identity),
}
assert tuple(_TASKS) == TASKS, "every model.task choice has a Task"


def task_of(name: str) -> Task:
    """The Task named by `model.task` (validated by the config checks)."""
    try:
        return _TASKS[name]
    except KeyError:
        raise ValueError(f"model.task={name!r} is not one of: {', '.join(TASKS)}") from None
