"""What the model learns from its labels (`model.task`): the loss, and what a prediction is.

For binary and regression the model's raw output is one float per sample, [B] fp32:
- binary: labels in {0, 1}; loss = mean binary cross-entropy with logits; a prediction is
  sigmoid(output), a probability.
- regression: float labels; loss = mean squared error of the raw output; a prediction is the
  raw output itself.
- retrieval: every row is a positive (user, item) pair, the label is not read; the output is
  (query vectors, candidate vectors) and the loss a softmax over the global batch's items
  (hybridrec.train.retrieval: it gathers every rank's items, so it lives above the model); a
  prediction is the raw score.
Every loss is a mean over the batch: the gradient-scaling convention (hybridrec.shard: each
rank's loss is a mean over its slice, the sharded exchanges scale by 1/W) builds on it.

A model's own loss: a model class that defines `loss(outputs, batch: LossBatch)` is trained
on it instead (regularisers included); `batch.task_loss(outputs)` is model.task's loss on the
same batch. Its forward may return a tuple (outputs, anything its loss needs, such as the
rows it looked up): binary and regression score the first element (`task_outputs`).

The contract that keeps a loss equal to one process at any world size: rank r's loss L_r
on its slice must make (1/W) sum_r L_r the one-process loss L on the global batch, and see
other ranks' samples only through a collective whose backward returns each rank's gradient
to the owner (retrieval's task loss). Then DDP's average of dL_r/dw is dL/dw, and a row's
gradient, each rank's scaled by 1/W where it leaves the lookup and summed over ranks, is
dL/drow. It holds for a mean over the rank's own samples of per-sample terms (the task's
loss; a penalty on the rows each sample looked up: L2 weighted by how often a row occurs, as
SGD matrix factorisation applies it) plus terms every rank computes alike (a penalty on a
dense weight, or on rows every rank looks up alike, such as shared negatives). It fails for
a sum over samples (W times too small), a penalty on the batch's distinct rows (a row met
on two ranks counts twice) or anything normalised per slice.
Everything task-dependent on the model side is chosen here, by `task_of(cfg.task)`; the
metrics a task reports are chosen in hybridrec.train.metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridrec.types import TASKS, KeyedIds


def bce_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of logits [B] against labels [B] in {0, 1}."""
    return nn.functional.binary_cross_entropy_with_logits(outputs.float(), labels.float())


def mse_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean squared error of raw outputs [B] against float labels [B]."""
    return nn.functional.mse_loss(outputs.float(), labels.float())


def _identity(outputs: torch.Tensor) -> torch.Tensor:
    return outputs


def task_outputs(outputs: Any) -> torch.Tensor:
    """The outputs [B] binary and regression score: the forward's tensor, or the first
    element of the tuple it returns (the rest are for the model's own loss), in fp32."""
    if isinstance(outputs, tuple | list) and outputs:
        outputs = outputs[0]
    if not isinstance(outputs, torch.Tensor):
        raise ValueError(
            "the model's forward must return its outputs [B] (or a tuple that starts with "
            f"them), got {type(outputs).__name__}"
        )
    return outputs.float()


def _needs_the_group(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    raise TypeError(
        "model.task=retrieval's loss gathers every rank's items: call "
        "hybridrec.retrieval_loss(query, candidates, item_ids, group=...)"
    )


def _next_item_loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    raise TypeError(
        "model.task=next_item's loss reads every position of the sequences (and with the "
        "softmax, every rank's items): hybridrec.train.next_item's objective computes it"
    )


@dataclass(frozen=True)
class Task:
    """A task's loss (outputs [B], labels [B] -> mean over B) and prediction (outputs -> [B]).
    Retrieval's loss is hybridrec.train.retrieval's (it needs the process group)."""

    name: str
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    predict: Callable[[torch.Tensor], torch.Tensor]


_TASKS = {
    "binary": Task("binary", bce_loss, torch.sigmoid),
    "regression": Task("regression", mse_loss, _identity),
    "retrieval": Task("retrieval", _needs_the_group, _identity),
    "next_item": Task("next_item", _next_item_loss, _identity),
}
assert tuple(_TASKS) == TASKS, "every model.task choice has a Task"


def task_of(name: str) -> Task:
    """The Task named by `model.task` (validated by the config checks)."""
    try:
        return _TASKS[name]
    except KeyError:
        raise ValueError(f"model.task={name!r} is not one of: {', '.join(TASKS)}") from None


@dataclass(frozen=True)
class LossBatch:
    """What a model's own `loss(outputs, batch)` gets: this rank's slice of the global batch,
    dense [b, F], ids by feature, labels [b], and `task_loss(outputs)`: model.task's loss of
    `outputs` on it (retrieval's gathers every rank's items: the trainer binds the group)."""

    dense: torch.Tensor
    ids: KeyedIds
    labels: torch.Tensor
    task_loss: Callable[[Any], torch.Tensor]
