"""Which rows make global batch `step` of a split: block shuffling, epochs, the last batch.

A split is a row range [start, end) of a dataset whose arrays are stored in blocks of R rows.
Its *units* are the blocks it overlaps, clipped to the split (so only the first and last unit
can be short). One epoch streams the units in an order that is a pure function of
(seed, split, epoch): shuffled for the train split, file order for the others. Global batch
`step` is epoch `step // steps_per_epoch`, stream positions [k*B, (k+1)*B) with
k = `step % steps_per_epoch`. Being a function of `step` alone is what makes resuming exact
(a checkpoint stores the next step) and keeps every rank on the same number of steps.

The last, partial batch of an epoch is dropped (`last_batch="drop"`: steps_per_epoch = n // B)
or filled by wrapping around to the start of the same epoch's stream (`"pad"`:
ceil(n / B) steps; a batch larger than the split wraps more than once).

`segments(step, lo, hi)` gives the absolute row ranges holding samples [lo, hi) of the global
batch, in order, each inside one stored block (what DALI's region reads need).
"""

from __future__ import annotations

import math
import threading

import numpy as np

LAST_BATCH = ("drop", "pad")


class BatchPlan:
    """The batch -> rows mapping of one split for one global batch size."""

    def __init__(
        self,
        start: int,
        end: int,
        block_rows: int,
        batch_size: int,
        shuffle: bool,
        seed: int,
        last_batch: str = "drop",
        name: str = "train",
    ) -> None:
        if last_batch not in LAST_BATCH:
            raise ValueError(f"last_batch={last_batch!r} is not one of: {', '.join(LAST_BATCH)}")
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.start, self.end, self.rows = start, end, end - start
        self.block_rows, self.batch_size = block_rows, batch_size
        self.shuffle, self.seed, self.last_batch, self.name = shuffle, seed, last_batch, name
        if self.rows <= 0:
            self.steps_per_epoch = 0
            return
        blocks = np.arange(start // block_rows, (end - 1) // block_rows + 1, dtype=np.int64)
        self.unit_start = np.maximum(blocks * block_rows, start)
        self.unit_end = np.minimum((blocks + 1) * block_rows, end)
        if last_batch == "drop":
            self.steps_per_epoch = self.rows // batch_size
        else:
            self.steps_per_epoch = math.ceil(self.rows / batch_size)
        self._orders: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    @property
    def key(self) -> tuple:
        return (
            self.start,
            self.end,
            self.block_rows,
            self.batch_size,
            self.shuffle,
            self.seed,
            self.last_batch,
        )

    def max_segments(self, rows: int) -> int:
        """An upper bound on len(segments(step, lo, lo + rows)) for any step."""
        wraps = math.ceil(rows / max(self.rows, 1)) + 1
        return math.ceil(rows / self.block_rows) + 3 * wraps + 2

    def order(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(unit starts, unit ends, cumulative stream ends) of `epoch`, units in stream order."""
        with self._lock:
            cached = self._orders.get(epoch)
            if cached is not None:
                return cached
        n = self.unit_start.size
        if self.shuffle:
            perm = np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(n)
        else:
            perm = np.arange(n)
        starts, ends = self.unit_start[perm], self.unit_end[perm]
        result = (starts, ends, np.cumsum(ends - starts))
        with self._lock:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = result
        return result

    def _stream(self, epoch: int, a: int, b: int, out: list[tuple[int, int]]) -> None:
        """Append the rows at stream positions [a, b) of `epoch` (0 <= a <= b <= rows)."""
        starts, ends, cum = self.order(epoch)
        i = int(np.searchsorted(cum, a, side="right"))
        while a < b:
            size = int(ends[i] - starts[i])
            offset = a - (int(cum[i]) - size)
            take = min(b - a, size - offset)
            first = int(starts[i]) + offset
            out.append((first, first + take))
            a += take
            i += 1

    def segments(self, step: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
        """Absolute row ranges of samples [lo, hi) of global batch `step`, in order."""
        hi = self.batch_size if hi is None else hi
        if not 0 <= lo <= hi <= self.batch_size:
            raise ValueError(f"slice [{lo}, {hi}) is outside a batch of {self.batch_size}")
        if self.steps_per_epoch == 0:
            raise ValueError(self.too_small())
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, k = divmod(step, self.steps_per_epoch)
        pos, stop = k * self.batch_size + lo, k * self.batch_size + hi
        out: list[tuple[int, int]] = []
        while pos < stop:  # wraps only in the padded last batch
            s = pos % self.rows
            take = min(stop - pos, self.rows - s)
            self._stream(epoch, s, s + take, out)
            pos += take
        return out

    def too_small(self) -> str:
        return (
            f"split {self.name!r} has {self.rows} rows, fewer than one global batch of "
            f"{self.batch_size} (with data.last_batch=drop); lower the batch size or set "
            "data.last_batch=pad"
        )


def merge_contiguous(segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Join ranges that continue one another (fewer, larger copies for the memmap reader)."""
    out: list[tuple[int, int]] = []
    for a, b in segments:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
