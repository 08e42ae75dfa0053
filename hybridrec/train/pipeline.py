"""The training pipeline: owns look-ahead, so a step only computes.

`next()` hands out the batch to train on, on the device. When an embedding module prefetches
(host-resident tables), `prefetch_next()`, called by the trainer between a step's forward and
its backward, reads the following batch, copies it to the device and has every such module
stage it (its ids checked and distributed, its rows on their way to the device caches, all
while the backward runs); the next `next()` hands that batch out together with what was
staged for it (`EmbeddingModule.use_staged`): a value (hybridrec.sparse.sharded.Staged)
holding the checked ids, their lookup inputs and what each host cache's prefetch admitted,
which the lookup of those rows takes (a mismatch is an error there). Without such modules it
reads no batch ahead beyond the device copy in flight (hybridrec.data.device.DevicePrefetcher).
How far ahead it stages is `LOOK_AHEAD`, defined here alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hybridrec.data.device import DevicePrefetcher
from hybridrec.sparse.api import EmbeddingModule, IdCounts
from hybridrec.types import Batch

log = logging.getLogger("hybridrec")

LOOK_AHEAD = 1
"""How many steps ahead of the one training the pipeline stages a batch: the batch staged
during step n (between its forward and its backward) trains at step n + LOOK_AHEAD
(`staged_step`). One, because the backward of one step is the time there is to hide the
staging in (ids checked and exchanged, host rows on their way to the device caches), and one
staged batch fills it; a deeper look-ahead would keep several staged values alive and make
every host cache hold the rows of LOOK_AHEAD + 1 batches at once. Those that depend on it:
the trainer stages no batch past the last step and tells the objective which step a staged
batch trains at (retrieval's negatives are drawn per step: hybridrec.train.objective
.stage_ids); the planner's floor of a host cache, CachePolicy.min_batches = 2 (one step's rows
and the staged ones), is LOOK_AHEAD + 1 (the planner imports no train module: a test ties
the two)."""


def staged_step(step: int) -> int:
    """The training step (counted from 1) at which the batch staged during step `step`
    trains (LOOK_AHEAD)."""
    return step + LOOK_AHEAD


class TrainPipeline:
    """Batches for training on `device`, with the sparse prefetch of the next one."""

    def __init__(
        self,
        loader: Iterator[Batch],
        device: torch.device,
        modules: list[EmbeddingModule],
        select: Callable[[EmbeddingModule, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`select(module, ids)`: the columns of a batch's ids a module looks up (None: all
        of them, as DLRM's one collection)."""
        self.loader = DevicePrefetcher(loader, device)
        self.select = select or (lambda module, ids: ids)
        self.device = device
        self.modules = [m for m in modules if m.prefetches]
        self._next: tuple[Batch, list[Any]] | None = None

    def next(self) -> Batch:
        """The batch to train on now (staged on the modules if it was prefetched: their next
        forward, of this batch, takes what prefetch_next() staged for it)."""
        if self._next is not None:
            batch, staged = self._next
            self._next = None
            for module, st in zip(self.modules, staged, strict=True):
                module.use_staged(st)
            return batch
        return next(self.loader).to(self.device, non_blocking=True)

    def prefetch_next(self) -> None:
        """Read the next batch and let the modules that prefetch stage it (collective on
        several ranks: every rank calls it at the same point). No-op without such modules."""
        if not self.modules:
            return
        batch = next(self.loader).to(self.device, non_blocking=True)
        self._next = (batch, [m.prefetch(self.select(m, batch.ids)) for m in self.modules])

    def close(self) -> None:
        self.loader.close()


def warm_start(
    modules: list[EmbeddingModule],
    counts: IdCounts | None,
    batch_size: int,
    remap: Callable[[EmbeddingModule, IdCounts], IdCounts] | None = None,
) -> int:
    """Load each host cache's most frequent rows when the data knows its id frequencies (a
    manifest's counts, or synthetic data's popularity); returns the rows loaded on this rank.
    `remap(module, counts)`: the counts as a module indexes its features (None: the same)."""
    if counts is None:
        log.info("host caches start empty (the data source records no id frequencies)")
        return 0
    starts = [m.warm_start(remap(m, counts) if remap else counts, batch_size) for m in modules]
    loaded = sum(w.rows for w in starts)
    log.info("host caches warm-started with %d rows from the dataset's id counts", loaded)
    for w in starts:
        if w.expected_hit_rate is not None:
            log.info(
                "host caches: expected hit rate %.3f of each batch's distinct rows while "
                "ids follow those counts (the best any fixed set of rows this size does)",
                w.expected_hit_rate,
            )
    return loaded
