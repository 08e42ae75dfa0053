"""From a data source to the batches each rank trains on.

A *source* (BatchSource, below: the whole of what the trainer, loaders and input checks ask of
one) serves global batches by index: `source.batch(step, batch_size, split)` -> Batch of
`batch_size` samples (the same on every rank that asks). `steps_per_epoch(batch_size, split)`
says how many full batches a split has (None = endless, like the synthetic stream).
`slice_batch(step, batch_size, split, lo, hi)` gives samples [lo, hi) of that global batch
(file sources read them without the rest; per-rank loaders use it).

A *loader* walks a source from a start step and yields this rank's contiguous slice of each
global batch (rank r of W gets samples [r*B/W, (r+1)*B/W)), so every rank runs the same
number of steps and the union of the slices is exactly the global batch the single-process
reference sees. A split other than train may have a batch that W does not divide: every rank
then gets n = ceil(B/W) samples, the last ones padded with zero rows past the batch's end
(`rank_span`; the evaluator masks them out). `position` is the next step, which is all a
checkpoint needs to resume. The train split never ends; any other split with a finite
`steps_per_epoch` ends (StopIteration) after one pass, so evaluation covers it once.

Two loaders (data.loader): SliceLoader ("per_rank", here) reads every rank's own slice;
BroadcastLoader ("broadcast", hybridrec.data.broadcast) reads on rank 0 and broadcasts. Both
can read ahead in a background thread (Prefetcher), into pinned memory when CUDA is there.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from hybridrec.types import Batch

# data.loader: every rank reads its own slice | rank 0 reads and broadcasts
LOADERS = ("per_rank", "broadcast")


class BatchSource(ABC):
    """Global batches by index, and all a run may ask of the data that serves them.

    Every source answers every method: `batch` and `steps_per_epoch` are its own; the others
    default to "nothing to tell" (None), or to `batch` sliced, and a source that knows more
    overrides them. Nothing else is asked of a source (no attribute probing).
    `split` is "train", "eval" (the split evaluation reads) or a named held-out split.
    """

    @abstractmethod
    def batch(self, step: int, batch_size: int, split: str = "train") -> Batch:
        """Global batch `step` of `split`: `batch_size` samples, the same on every rank."""

    @abstractmethod
    def steps_per_epoch(self, batch_size: int, split: str = "train") -> int | None:
        """Full batches of `batch_size` in one pass over `split`; None = endless."""

    def slice_batch(self, step: int, batch_size: int, split: str, lo: int, hi: int) -> Batch:
        """Samples [lo, hi) of global batch `step` (what one rank keeps)."""
        return self.batch(step, batch_size, split).slice(lo, hi)

    def split_rows(self, split: str) -> int | None:
        """Rows in `split` (evaluation counts no sample past them); None = endless."""
        return None

    def id_counts(self, table_index: int) -> np.ndarray | None:
        """How often each id of feature `table_index` occurs in training, [num_embeddings]
        (any scale: host caches warm-start from the largest); None = not known."""
        return None

    def split_ids(
        self, split: str, columns: Sequence[int], start: int, stop: int
    ) -> np.ndarray | None:
        """Id columns `columns` (of a batch's ids [B, H]) of rows [start, stop) of `split`,
        in dataset order: [stop - start, len(columns)] int64; None = not known (an endless
        source). What retrieval reads its interactions from (hybridrec.data.interactions)."""
        return None

    def row_of(self, step: int, batch_size: int, split: str, sample: int) -> str | None:
        """Where sample `sample` of global batch `step` comes from, for error messages
        ("row 17 of dataset /data/x"); None = not known."""
        return None

    def dense_names(self) -> list[str] | None:
        """The dense features' names, in column order; None = not known."""
        return None

    def close(self) -> None:
        """Release files and reader threads (a no-op for a source that holds none)."""
        return None


def rank_span(batch_size: int, world_size: int, rank: int, split: str) -> tuple[int, int, int]:
    """(lo, hi, n): this rank keeps samples [lo, hi) of a global batch, padded to n.

    n = ceil(B/W) on every rank; only a split other than train may leave W not dividing B
    (a training batch must split evenly: the optimizer step averages equal slices)."""
    if batch_size % world_size and split == "train":
        raise ValueError(f"batch size {batch_size} is not divisible by {world_size} ranks")
    n = -(-batch_size // world_size)
    lo = min(rank * n, batch_size)
    return lo, min(lo + n, batch_size), n


def padded(batch: Batch, n: int) -> Batch:
    """`batch` with zero samples appended up to n (ids 0 exist in every table)."""
    extra = n - batch.size
    if extra <= 0:
        return batch
    return Batch(
        torch.cat([batch.dense, batch.dense.new_zeros(extra, *batch.dense.shape[1:])]),
        torch.cat([batch.ids, batch.ids.new_zeros(extra, *batch.ids.shape[1:])]),
        torch.cat([batch.labels, batch.labels.new_zeros(extra, *batch.labels.shape[1:])]),
    )


def epoch_limit(source: BatchSource, batch_size: int, split: str) -> int | None:
    """Steps a loader may take: None (endless) for train and endless sources, else one epoch."""
    return None if split == "train" else source.steps_per_epoch(batch_size, split)


class Prefetcher:
    """Calls `read(step)` for step = start, start + 1, ... (< limit) ahead of the consumer.

    With depth > 0 a daemon thread keeps up to `depth` results in a queue; with depth == 0 it
    reads on demand. `read` does the pinning, if any, so that it too happens off the training
    thread. `get()` returns ("ok", step, result), ("end", step, None) past `limit`, or
    ("error", step, exception) when `read` raised: the caller decides how to fail, so every
    rank can be told before anyone raises. Once "end" or "error" is reached it repeats.
    """

    def __init__(
        self,
        read: Callable[[int], object],
        start: int,
        limit: int | None,
        depth: int = 2,
    ) -> None:
        self.read, self.next_step, self.limit, self.depth = read, start, limit, depth
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._thread: threading.Thread | None = None
        self._final: tuple[str, int, object] | None = None  # "end"/"error" repeats once reached
        if depth > 0:
            self._thread = threading.Thread(
                target=self._run, name="hybridrec-prefetch", daemon=True
            )
            self._thread.start()

    def _one(self, step: int) -> tuple[str, int, object]:
        if self.limit is not None and step >= self.limit:
            return ("end", step, None)
        try:
            return ("ok", step, self.read(step))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, who re-raises it
            return ("error", step, e)

    def _run(self) -> None:
        step = self.next_step
        while not self._stop.is_set():
            item = self._one(step)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] != "ok":
                return
            step += 1

    def get(self) -> tuple[str, int, object]:
        if self._final is not None:
            return self._final
        if self._thread is None:
            item = self._one(self.next_step)
        else:
            while True:
                try:
                    item = self._queue.get(timeout=1.0)
                    break
                except queue.Empty:
                    if not self._thread.is_alive() and self._queue.empty():
                        raise RuntimeError("the prefetch thread died without a result") from None
        if item[0] == "ok":
            self.next_step = item[1] + 1
        else:
            self._final = item
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def pin_default() -> bool:
    """Pin host batches when there is a GPU to copy them to."""
    return torch.cuda.is_available()


def pinned(batch: Batch, pin: bool) -> Batch:
    return batch.pin_memory() if pin and batch.dense.device.type == "cpu" else batch


class SliceLoader:
    """Every rank reads its own slice of each global batch ("per_rank")."""

    def __init__(
        self,
        source: BatchSource,
        rank: int,
        world_size: int,
        batch_size: int,
        split: str = "train",
        start_step: int = 0,
        prefetch: int = 0,
        pin_memory: bool | None = None,
    ) -> None:
        self.lo, self.hi, self.n = rank_span(batch_size, world_size, rank, split)
        self.source, self.rank, self.world = source, rank, world_size
        self.batch_size, self.split, self.position = batch_size, split, start_step
        self.pin = pin_default() if pin_memory is None else pin_memory
        self._prefetch = Prefetcher(
            self._read, start_step, epoch_limit(source, batch_size, split), prefetch
        )

    def _read(self, step: int) -> Batch:
        batch = self.source.slice_batch(step, self.batch_size, self.split, self.lo, self.hi)
        return pinned(padded(batch, self.n), self.pin)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        status, step, value = self._prefetch.get()
        if status == "end":
            raise StopIteration
        if status == "error":
            raise value  # type: ignore[misc]
        self.position = step + 1
        return value  # type: ignore[return-value]

    def close(self) -> None:
        self._prefetch.close()
