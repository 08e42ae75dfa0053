"""A retrieval dataset's interactions: every row of a split is one (user, item) pair.

    pairs = Interactions(source, user_column, item_column, item_rows, declared="data")
    pairs.catalogue()              # [N] int64: the declared catalogue, ascending
    pairs.ranked()                 # [R] int64: its items that the train split names
    for chunk in pairs.chunks("train"): ...   # [n, 2] int64 (user id, item id), dataset order

The columns are a batch's id columns (hybridrec.types.hot_offsets) of the user feature and of
the item feature, read with BatchSource.split_ids in chunks of `chunk_rows` rows, so memory
never holds a whole split. A null or out-of-vocabulary id is an id like another; a spec that
encodes the item with `encoding: identity` keeps the raw ids (docs/training.md, Retrieval).

The catalogue (train.retrieval.catalogue, `declared`) is the set of items a retrieval model
ranks, draws sampled negatives from and exports:
- `data` (the default): every item the data names in any of its splits (train, val, test);
- `table`: every row of the item table, 0 .. item_rows - 1;
- a file of item ids: a `.npy` integer array, or text with one id per line;
- a list of item ids.
Ids are as the dataset's item column holds them (table rows; the raw ids with `encoding:
identity`). An item of the catalogue that the train split never names has a row no positive
ever trained: its vector is its random initial state, so it is never ranked (evaluation and
exports leave it out, and say how many there are) rather than outranking trained items by
chance. `ranked()` is the catalogue less those items.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from hybridrec.data.loader import BatchSource

SPLITS = ("train", "val", "test")
CATALOGUES = ("data", "table")  # besides a file of item ids or a list of them
KEY = "train.retrieval.catalogue"


class Interactions:
    """The (user, item) pairs of a source's splits and the catalogue they rank (module
    docstring); `declared`: train.retrieval.catalogue's value."""

    def __init__(
        self,
        source: BatchSource,
        user_column: int,
        item_column: int,
        item_rows: int,
        declared: str | Sequence[int] = "data",
        chunk_rows: int = 1 << 20,
    ) -> None:
        self.source, self.columns = source, (user_column, item_column)
        self.item_rows, self.chunk_rows = item_rows, chunk_rows
        self.declared = declared
        self._catalogue: np.ndarray | None = None
        self._present: dict[tuple[str, ...], np.ndarray] = {}

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

    def present(self, splits: Sequence[str]) -> np.ndarray:
        """[item_rows] bool: whether any row of `splits` names each item (read once, kept)."""
        key = tuple(splits)
        if key not in self._present:
            present = np.zeros(self.item_rows, dtype=bool)
            for split in splits:
                for pairs in self.chunks(split):
                    items = pairs[:, 1]
                    if items.size and (items.min() < 0 or items.max() >= self.item_rows):
                        bad = items[(items < 0) | (items >= self.item_rows)][0]
                        raise ValueError(
                            f"the {split} split holds item id {bad}, outside the item table's "
                            f"{self.item_rows} rows"
                        )
                    present[items] = True
            self._present[key] = present
        return self._present[key]

    def catalogue(self) -> np.ndarray:
        """The declared catalogue (module docstring), ascending: [N] int64 (read once)."""
        if self._catalogue is None:
            if self.declared == "data":
                items = np.flatnonzero(self.present(SPLITS)).astype(np.int64)
                if not items.size:
                    raise ValueError("model.task=retrieval: the dataset holds no interactions")
            else:
                items = declared_items(self.declared, self.item_rows)
            self._catalogue = items
        return self._catalogue

    def trained(self) -> np.ndarray:
        """[N] bool: whether the train split names each catalogue item."""
        return self.present(("train",))[self.catalogue()]

    def ranked(self) -> np.ndarray:
        """The catalogue's items that the train split names: [R] int64, ascending, what
        evaluation ranks and exports hold (module docstring)."""
        return self.catalogue()[self.trained()]

    def origin(self) -> str:
        """Where the catalogue comes from, in words: 'data: every item of the dataset's
        splits', 'table: ...', a file's path or a list's first ids."""
        what = {
            "data": "every item of the dataset's splits",
            "table": "every row of the item table",
        }.get(self.declared if isinstance(self.declared, str) else "", "")
        return _show(self.declared) + (f": {what}" if what else "")

    def describe(self) -> str:
        """One line: the catalogue's size, where it comes from, and the items never ranked."""
        n, ranked = len(self.catalogue()), len(self.ranked())
        line = f"retrieval catalogue: {n:,} items ({KEY}={self.origin()})"
        if ranked < n:
            line += (
                f"; {n - ranked:,} of them never in the train split, never ranked (untrained "
                f"rows), {ranked:,} ranked"
            )
        return line

    def earlier(self, split: str) -> tuple[str, ...]:
        """The splits whose items a user has met before `split`: train for val; train and
        val for test (each user's seen items, excluded from its ranking)."""
        return ("train", "val") if split == "test" else ("train",)


def _show(declared: str | Sequence[int]) -> str:
    if isinstance(declared, str):
        return declared
    ids = list(declared)
    return f"[{', '.join(map(str, ids[:3]))}{', ...' if len(ids) > 3 else ''}] ({len(ids)} ids)"


def read_item_ids(path: Path) -> np.ndarray:
    """The item ids of a catalogue file: a `.npy` 1-D integer array, or text with one
    integer id per line (blank lines skipped). ValueError naming the file (and line)."""
    where = f"{KEY}={path}"
    if not path.is_file():
        raise ValueError(
            f"{where}: no such file; give data, table, a file of item ids (.npy, or text "
            "with one id per line) or a list of ids"
        )
    if path.suffix == ".npy":
        try:
            ids = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"{where}: not a .npy array of integer item ids ({e})") from None
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"{where}: holds a {ids.dtype} array of shape {list(ids.shape)}; a catalogue "
                "is a 1-D integer array of item ids"
            )
        return ids.astype(np.int64)
    ids = []
    with path.open() as f:
        for n, line in enumerate(f, start=1):
            text = line.strip()
            if not text:
                continue
            try:
                ids.append(int(text))
            except ValueError:
                raise ValueError(
                    f"{where}: line {n} is {text[:40]!r}, not an item id (one integer per line)"
                ) from None
    return np.asarray(ids, dtype=np.int64)


def declared_items(declared: str | Sequence[int], item_rows: int) -> np.ndarray:
    """The items of a catalogue given as `table`, a file of ids or a list of ids (module
    docstring): [N] int64, ascending, each once; ValueError (one line) for ids outside the
    item table or an empty catalogue. (`data` needs the splits: Interactions.catalogue.)"""
    if declared == "table":
        return np.arange(item_rows, dtype=np.int64)
    if isinstance(declared, str):
        ids = read_item_ids(Path(declared))
    else:
        ids = np.asarray(list(declared), dtype=np.int64)
    if not ids.size:
        raise ValueError(f"{KEY}={_show(declared)}: the catalogue holds no item ids")
    bad = ids[(ids < 0) | (ids >= item_rows)]
    if bad.size:
        raise ValueError(
            f"{KEY}={_show(declared)}: item id {bad[0]} is outside the item table's "
            f"{item_rows} rows (ids as the dataset's item column holds them)"
        )
    return np.unique(ids)
