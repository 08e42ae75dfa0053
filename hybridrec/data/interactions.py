"""A retrieval dataset's interactions: every row of a split is one (user, item) pair.

    pairs = Interactions(source, user_column, item_column, item_rows)
    pairs.catalogue()              # [N] int64: every item id in any split, ascending
    for chunk in pairs.chunks("train"): ...   # [n, 2] int64 (user id, item id), dataset order

The columns are a batch's id columns (hybridrec.types.hot_offsets) of the user feature and of
the item feature, read with BatchSource.split_ids in chunks of `chunk_rows` rows, so memory
never holds a whole split. The catalogue is every item the data names in any of its splits
(train, val, test): the items a retrieval model ranks, sampled negatives come from and
exports hold. A null or out-of-vocabulary id is an id like another; a spec that encodes the
item with `encoding: identity` keeps the raw ids (docs/training.md, Retrieval).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from hybridrec.data.loader import BatchSource

SPLITS = ("train", "val", "test")


class Interactions:
    """The (user, item) pairs of a source's splits (module docstring)."""

    def __init__(
        self,
        source: BatchSource,
        user_column: int,
        item_column: int,
        item_rows: int,
        chunk_rows: int = 1 << 20,
    ) -> None:
        self.source, self.columns = source, (user_column, item_column)
        self.item_rows, self.chunk_rows = item_rows, chunk_rows
        self._catalogue: np.ndarray | None = None

    def rows(self, split: str) -> int:
        """Rows of `split`; 0 for a split the data does not have."""
        try:
            n = self.source.split_rows(split)
        except ValueError:  # not a split of this dataset
            return 0
        if n is None:
            raise ValueError(
                "model.task=retrieval reads every interaction of a split: it needs a file "
                "dataset (data=table), not an endless stream"
            )
        return n

    def chunks(self, split: str) -> Iterator[np.ndarray]:
        """[n, 2] int64 (user, item) of every row of `split`, in order, chunk by chunk."""
        total = self.rows(split)
        for start in range(0, total, self.chunk_rows):
            stop = min(start + self.chunk_rows, total)
            got = self.source.split_ids(split, self.columns, start, stop)
            if got is None:
                raise ValueError(
                    f"model.task=retrieval reads the {split} split's interactions; this data "
                    "source cannot give them: use data=table"
                )
            yield got

    def catalogue(self) -> np.ndarray:
        """Every item id of any split, ascending: [N] int64 (read once, then kept)."""
        if self._catalogue is None:
            present = np.zeros(self.item_rows, dtype=bool)
            for split in SPLITS:
                for pairs in self.chunks(split):
                    items = pairs[:, 1]
                    if items.size and (items.min() < 0 or items.max() >= self.item_rows):
                        bad = items[(items < 0) | (items >= self.item_rows)][0]
                        raise ValueError(
                            f"the {split} split holds item id {bad}, outside the item table's "
                            f"{self.item_rows} rows"
                        )
                    present[items] = True
            self._catalogue = np.flatnonzero(present).astype(np.int64)
            if not self._catalogue.size:
                raise ValueError("model.task=retrieval: the dataset holds no interactions")
        return self._catalogue

    def earlier(self, split: str) -> tuple[str, ...]:
        """The splits whose items a user has met before `split`: train for val; train and
        val for test (each user's seen items, excluded from its ranking)."""
        return ("train", "val") if split == "test" else ("train",)
