"""From a data source to the batches each rank trains on.

A *source* serves global batches by index: `source.batch(step, batch_size, split)` -> Batch of
`batch_size` samples (the same on every rank that asks). `steps_per_epoch(batch_size, split)`
says how many full batches a split has (None = endless, like the synthetic stream).

A *loader* walks a source from a start step and yields this rank's contiguous slice of each
global batch (rank r of W gets samples [r*B/W, (r+1)*B/W)), so every rank runs the same
number of steps and the union of the slices is exactly the global batch the single-process
reference sees. `position` is the next step, which is all a checkpoint needs to resume.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from hybridrec.types import Batch


class BatchSource(Protocol):
    def batch(self, step: int, batch_size: int, split: str = "train") -> Batch: ...

    def steps_per_epoch(self, batch_size: int, split: str = "train") -> int | None: ...


class SliceLoader:
    """Every rank reads the global batch from the source and keeps its slice."""

    def __init__(
        self,
        source: BatchSource,
        rank: int,
        world_size: int,
        batch_size: int,
        split: str = "train",
        start_step: int = 0,
    ) -> None:
        if batch_size % world_size:
            raise ValueError(f"batch size {batch_size} is not divisible by {world_size} ranks")
        self.source, self.rank, self.world = source, rank, world_size
        self.batch_size, self.split, self.position = batch_size, split, start_step

    def local_slice(self, batch: Batch) -> Batch:
        n = batch.size // self.world
        return batch.slice(self.rank * n, (self.rank + 1) * n)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = self.source.batch(self.position, self.batch_size, self.split)
        self.position += 1
        return self.local_slice(batch)

    def close(self) -> None:
        pass
