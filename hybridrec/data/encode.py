"""Categorical encodings (raw hex value -> embedding row id) and the counters behind them.

Two encodings, chosen at preprocessing time and recorded in the manifest:

- **hash**: id = value mod cap_t, one cap per table (MLPerf's 40M). An empty field is the
  value 0, as in MLPerf's reference preprocessing. Table t has cap_t rows.
- **vocab**: a frequency-thresholded vocabulary per table, counted over the train split.
  id 0 = missing (empty field), id 1 = rare (seen fewer than `min_count` times in train, or
  never: every val/test value outside the vocabulary lands here), ids 2.. = the kept values
  in order of decreasing train frequency (ties by value), so hot rows have small ids.
  Table t has 2 + kept_t rows.

Counting is sparse and exact: a SparseCounter holds sorted (key, count) pairs and folds each
chunk in with np.unique + a sorted merge, so its memory is 16 bytes per distinct key seen,
whatever the number of rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MISSING_ID = 0
RARE_ID = 1


class SparseCounter:
    """Exact counts of uint64 (or int64) keys: 16 bytes per distinct key."""

    def __init__(self, dtype: type = np.uint64) -> None:
        self.keys = np.empty(0, dtype)
        self.counts = np.empty(0, np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_len = 0

    def add(self, keys: np.ndarray) -> None:
        if keys.size == 0:
            return
        u, c = np.unique(keys, return_counts=True)
        self.add_counts(u, c.astype(np.int64))

    def add_counts(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """Fold in (key, count) pairs; keys need not be unique or sorted."""
        self._pending.append((keys.astype(self.keys.dtype, copy=False), counts))
        self._pending_len += keys.size
        if self._pending_len > max(1 << 16, self.keys.size):  # memory <= 2x distinct + 1 MiB
            self._compact()

    def _compact(self) -> None:
        if not self._pending:
            return
        keys = np.concatenate([self.keys] + [k for k, _ in self._pending])
        counts = np.concatenate([self.counts] + [c for _, c in self._pending])
        self._pending, self._pending_len = [], 0
        if keys.size == 0:  # only empty pairs were added (e.g. a file with no train rows)
            self.keys, self.counts = keys, counts
            return
        order = np.argsort(keys, kind="stable")
        keys, counts = keys[order], counts[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        self.keys, self.counts = keys[starts], np.add.reduceat(counts, starts)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys ascending, counts), both [distinct]."""
        self._compact()
        return self.keys, self.counts


class HashEncoder:
    """id = value mod cap_t (empty = value 0)."""

    kind = "hash"

    def __init__(self, caps: list[int]) -> None:
        self.caps = np.asarray(caps, np.uint64)

    def encode(self, cat: np.ndarray, missing: np.ndarray) -> np.ndarray:
        """[n, 26] uint64 raw values (+ missing mask, already 0) -> [n, 26] int32 ids."""
        return (cat % self.caps).astype(np.int32)

    def num_embeddings(self) -> list[int]:
        return [int(c) for c in self.caps]


def build_vocab(values: np.ndarray, counts: np.ndarray, min_count: int) -> dict[str, np.ndarray]:
    """One table's vocabulary from its train counts (values ascending, counts).

    Returns `values` (kept values, ascending) and `ids` (their ids, >= 2), plus `counts`: the
    train count of every id 2.. in id order (ids 0 and 1 are filled in by the caller).
    """
    keep = counts >= min_count
    kept_values, kept_counts = values[keep], counts[keep]
    order = np.lexsort((kept_values, -kept_counts))  # by count desc, then value asc
    ids = np.empty(kept_values.size, np.int64)
    ids[order] = np.arange(kept_values.size) + 2
    return {"values": kept_values, "ids": ids, "counts": kept_counts[order]}


class VocabEncoder:
    """Raw value -> id through sorted per-table vocabularies (memory-mapped, shared by workers)."""

    kind = "vocab"

    def __init__(self, vocab_dir: Path, num_tables: int) -> None:
        self.values = [
            np.load(vocab_dir / f"cat_{t}.values.npy", mmap_mode="r", allow_pickle=False)
            for t in range(num_tables)
        ]
        self.ids = [
            np.load(vocab_dir / f"cat_{t}.ids.npy", mmap_mode="r", allow_pickle=False)
            for t in range(num_tables)
        ]

    def encode(self, cat: np.ndarray, missing: np.ndarray) -> np.ndarray:
        out = np.empty(cat.shape, np.int32)
        for t, (values, ids) in enumerate(zip(self.values, self.ids, strict=True)):
            col = cat[:, t]
            if values.size == 0:
                out[:, t] = RARE_ID
            else:
                pos = np.minimum(np.searchsorted(values, col), values.size - 1)
                out[:, t] = np.where(values[pos] == col, ids[pos], RARE_ID)
            out[missing[:, t], t] = MISSING_ID
        return out
