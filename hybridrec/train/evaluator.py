"""Exact evaluation over held-out batches, the same on every rank and for any world size.

Each rank scores its slice of every global eval batch; the outputs, labels and a "real
sample" mask are gathered from all ranks and the metrics (hybridrec.train.metrics) computed
once over the whole set, those of model.task (binary: AUC, log loss, ...; regression:
MSE, RMSE, MAE). A file split's last batch is filled by wrapping around to its start;
samples at global positions past the split's rows are masked out, so every row counts once.
On one process those wrapped samples are not even scored (the batch is cut to the split's
end), so what a forward counts (dynamic tables' ids without a row, `unknown_rate`) covers the
split's rows only; on several ranks every rank's slice is scored whole (the trainer's
exchanges take equal slices) and the padding's ids are counted by the dynamic maps too.
An eval batch that the world size does not divide reaches each rank padded to ceil(B/W)
samples (hybridrec.data.loader.rank_span); the padding is masked out too, so the metrics are
those of the single-process reference whatever the world size.

`chunk` bounds the samples one forward takes: host caches hold one training batch's rows, so
a model with one evaluates in chunks of the local training batch (the same count of chunks on
every rank, since every rank holds the same number of samples).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

import torch

from hybridrec.distributed.comm import all_gather_rows
from hybridrec.distributed.env import DistEnv
from hybridrec.train.metrics import eval_metrics
from hybridrec.types import Batch


@torch.no_grad()
def evaluate(
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    loader: Iterator[Batch],
    env: DistEnv,
    batch_size: int,
    batches: int | None,
    split_rows: int | None,
    autocast: torch.autocast,
    check_inputs: Callable[[], None],
    task: str,
    chunk: int | None = None,
    check_dense: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None,
) -> dict[str, float]:
    """model.task `task`'s metrics over `batches` global batches of `batch_size` (None: the
    whole split of `split_rows` rows, or the loader's end); {} when the loader yields nothing.
    `score(dense [b, F], ids [b, H]) -> outputs [b]`: the model's forward, in eval mode."""
    world = env.world_size
    local_batch = -(-batch_size // world)
    first = env.rank * local_batch + torch.arange(local_batch, device=env.device)
    in_batch = first < batch_size  # False: padding past an uneven batch's end
    limit = split_rows if split_rows is not None else math.inf
    logits, labels, real = [], [], []
    try:
        for step, batch in enumerate(itertools.islice(loader, batches)):
            batch = batch.to(env.device)
            rows = batch.size
            if world == 1:  # the wrapped rows of a split's last batch need no forward here
                rows = min(rows, max(0, limit - step * batch_size))
                batch = batch.slice(0, rows) if rows < batch.size else batch
            if not rows:
                continue
            dense = batch.dense
            if check_dense is not None:  # NaN or inf features (hybridrec.train.dense_check)
                dense = check_dense(dense, step, env.rank * local_batch)
            with autocast:
                for lo in range(0, rows, chunk or rows):
                    hi = lo + (chunk or rows)
                    logits.append(score(dense[lo:hi], batch.ids[lo:hi]).float())
            labels.append(batch.labels)
            real.append((in_batch & (first + step * batch_size < limit))[:rows])
    finally:
        loader.close()  # type: ignore[attr-defined]
    check_inputs()  # no metrics from batches with bad ids or non-finite dense features
    if not logits:
        return {}
    local = torch.stack([torch.cat(logits), torch.cat(labels), torch.cat(real).float()])
    if env.group is not None and world > 1:  # (one rank sliced its last batch: no reorder)
        # [3, W * n]: rank p's columns at block p, then in global sample order (batch by
        # batch, rank by rank): the metrics' sums in the order one process adds them
        local = all_gather_rows(local.T.contiguous(), env.group, name="eval_gather").T
        local = local.reshape(3, world, -1, local_batch).transpose(1, 2).reshape(3, -1)
    local = local[:, local[2] > 0]
    metrics = eval_metrics(local[0], local[1], task)
    metrics["eval_samples"] = int(local.shape[1])
    return metrics
