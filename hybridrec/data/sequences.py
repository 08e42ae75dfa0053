"""Per-user item sequences for next-item models (SASRec, HSTU), and the leave-one-out split.

    seqs = read_user_item("amazon_games.txt")          # `user item` lines, 1-based ids
    seqs = sequences_from_table(users, items, times)   # an interaction table's columns
    split = LeaveOneOut(seqs)
    windows = split.train_windows(50)      # [U_train, 51]: inputs [:, :50], targets [:, 1:]
    ev = split.eval_split("test", 50)      # inputs [Q, 50], targets [Q], the users' histories

A `Sequences` holds every user's events oldest first, as item rows of the item table
(0-based: row r is item r; the `user item` format's 1-based item i is row i - 1). The
sequences are one flat array with offsets, so memory is one int64 per event.

Leave-one-out (Kang and McAuley, SASRec, ICDM 2018, and its public implementations): a user
with n >= 3 events has train = its first n - 2, val = event n - 2 and test = event n - 1
(0-based); the val input is the train sequence and the test input train + val. A user with
fewer than 3 events trains on all of them and is not evaluated.

Padded arrays (`last_events`) follow the engine's sequence contract: left-aligned, position 0
the oldest kept event, PAD = -1 past a sequence's length, truncated to the most recent
`max_len` events. Only numpy here: preprocessing may read sequences without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAD = -1  # the id of a padded position
SPLITS = ("val", "test")


@dataclass(frozen=True)
class Sequences:
    """Every user's events in time order: user `users[u]`'s item rows are
    `items[offsets[u]:offsets[u + 1]]`, oldest first. users [U] (the source's user ids, in
    ascending order), offsets [U + 1] int64, items [E] int64 in [0, num_items)."""

    users: np.ndarray
    offsets: np.ndarray
    items: np.ndarray
    num_items: int

    def __len__(self) -> int:
        return len(self.users)

    def lengths(self) -> np.ndarray:
        """[U] int64: each user's number of events."""
        return np.diff(self.offsets)

    def of(self, u: int) -> np.ndarray:
        """User index u's item rows, oldest first."""
        return self.items[self.offsets[u] : self.offsets[u + 1]]


def _parse_error(path: Path, line_no: int, text: str, why: str) -> ValueError:
    return ValueError(f"{path}:{line_no}: {why} (line {text.strip()[:60]!r})")


def read_user_item(path: str | Path, num_items: int | None = None) -> Sequences:
    """The `user item` per-line format that sequential-recommendation repositories ship
    (SASRec's data/*.txt): one event per line, two integers >= 1 separated by whitespace, a
    user's lines contiguous and oldest first. Items become rows item - 1; `num_items`: the
    item table's rows (None: the largest item id). ValueError naming the file and line of a
    malformed line, an id below 1, or a user whose lines are not contiguous."""
    path = Path(path)
    users: list[int] = []
    items: list[int] = []
    starts: list[int] = []
    seen: set[int] = set()
    with open(path, encoding="utf-8") as f:
        for line_no, text in enumerate(f, 1):
            fields = text.split()
            if not fields:
                raise _parse_error(path, line_no, text, "an empty line; each line is 'user item'")
            if len(fields) != 2:
                raise _parse_error(
                    path, line_no, text, f"{len(fields)} fields; each line is 'user item'"
                )
            try:
                user, item = int(fields[0]), int(fields[1])
            except ValueError:
                raise _parse_error(path, line_no, text, "user and item must be integers") from None
            if user < 1 or item < 1:
                raise _parse_error(path, line_no, text, "ids start at 1 in this format")
            if not users or user != users[-1]:
                if user in seen:
                    raise _parse_error(
                        path,
                        line_no,
                        text,
                        f"user {user} appears again after other users' lines; a user's "
                        "lines must be contiguous (oldest first)",
                    )
                seen.add(user)
                users.append(user)
                starts.append(len(items))
            items.append(item - 1)
    if not items:
        raise ValueError(f"{path}: no events; each line is 'user item'")
    rows = np.asarray(items, dtype=np.int64)
    if num_items is not None and int(rows.max()) >= num_items:
        at = int(np.flatnonzero(rows >= num_items)[0])  # one event per line
        raise ValueError(
            f"{path}:{at + 1}: item {int(rows[at]) + 1} is past the item table's {num_items} "
            "rows (ids 1..num_items)"
        )
    offsets = np.asarray(starts + [len(items)], dtype=np.int64)
    order = np.argsort(np.asarray(users), kind="stable")  # users ascending, events kept
    ids = np.asarray(users, dtype=np.int64)[order]
    lengths = np.diff(offsets)[order]
    flat = np.concatenate([rows[offsets[u] : offsets[u + 1]] for u in order])
    return _checked(ids, np.concatenate([[0], np.cumsum(lengths)]), flat, num_items, str(path))


def sequences_from_table(
    users: np.ndarray,
    items: np.ndarray,
    times: np.ndarray,
    num_items: int | None = None,
    name: str = "interaction table",
) -> Sequences:
    """Sequences from an interaction table's columns, one row per event: users [E] (any
    integer ids), items [E] (item rows, 0-based integers), times [E] (any orderable numbers).
    Grouped by user (ascending), ordered by time, equal times by item row. `num_items`: the
    item table's rows (None: the largest row + 1). ValueError naming `name` and the row of a
    negative or too large item, or a NaN time."""
    users, items, times = np.asarray(users), np.asarray(items), np.asarray(times)
    if not (users.shape == items.shape == times.shape) or users.ndim != 1:
        raise ValueError(
            f"{name}: users, items and times must be columns of one length; got shapes "
            f"{users.shape}, {items.shape}, {times.shape}"
        )
    if not len(items):
        raise ValueError(f"{name}: no events")
    for key, col in (("user", users), ("item", items)):
        if not np.issubdtype(col.dtype, np.integer):
            raise ValueError(
                f"{name}: the {key} column holds {col.dtype}, not integers; encode it first "
                "(a dataset spec's vocabulary encoding gives integer rows)"
            )
    if np.issubdtype(times.dtype, np.floating) and np.isnan(times).any():
        row = int(np.flatnonzero(np.isnan(times))[0])
        raise ValueError(f"{name}: row {row} has a NaN time; drop or fill it first")
    order = np.lexsort((items, times, users))  # by user, then time, then item
    u, rows = users[order].astype(np.int64), items[order].astype(np.int64)
    firsts = np.flatnonzero(np.r_[True, u[1:] != u[:-1]])
    offsets = np.r_[firsts, len(u)].astype(np.int64)
    return _checked(u[firsts], offsets, rows, num_items, name, order)


def read_interaction_table(
    path: str | Path,
    user: str = "user",
    item: str = "item",
    time: str = "timestamp",
    item_base: int = 0,
    num_items: int | None = None,
) -> Sequences:
    """`sequences_from_table` over a Parquet file or a CSV file with a header (by suffix:
    .parquet, else CSV) whose columns `user`, `item` and `time` hold integers (times: any
    numbers); item rows are item - `item_base`. ValueError naming the file and the missing
    column."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    path = Path(path)
    table = pq.read_table(path) if path.suffix == ".parquet" else pacsv.read_csv(path)
    missing = [c for c in (user, item, time) if c not in table.column_names]
    if missing:
        raise ValueError(
            f"{path}: no column {missing[0]!r}; its columns are {table.column_names} (name "
            "them with user=, item=, time=)"
        )
    cols = [table.column(c).to_numpy() for c in (user, item, time)]
    items = cols[1]
    if np.issubdtype(items.dtype, np.integer):
        items = items - item_base
    return sequences_from_table(cols[0], items, cols[2], num_items, str(path))


def _checked(
    users: np.ndarray,
    offsets: np.ndarray,
    items: np.ndarray,
    num_items: int | None,
    name: str,
    order: np.ndarray | None = None,
) -> Sequences:
    """Sequences after checking every item row against [0, num_items)."""
    limit = int(items.max()) + 1 if num_items is None else int(num_items)
    bad = np.flatnonzero((items < 0) | (items >= limit))
    if len(bad):
        at = int(bad[0] if order is None else order[bad[0]])
        raise ValueError(
            f"{name}: row {at} has item row {int(items[bad[0]])}, outside the item table's "
            f"[0, {limit}) rows"
        )
    return Sequences(users, offsets.astype(np.int64), items, limit)


def last_events(
    starts: np.ndarray, ends: np.ndarray, items: np.ndarray, max_len: int
) -> np.ndarray:
    """[U, max_len] int64: each sequence's most recent `max_len` events, left-aligned (the
    oldest kept at position 0), PAD past its length. Sequence u is items[starts[u]:ends[u]]."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    kept = np.minimum(ends - starts, max_len)
    out = np.full((len(starts), max_len), PAD, dtype=np.int64)
    rows = np.repeat(np.arange(len(starts)), kept)
    cols = np.arange(int(kept.sum())) - np.repeat(np.cumsum(kept) - kept, kept)
    out[rows, cols] = items[np.repeat(ends - kept, kept) + cols]
    return out


@dataclass(frozen=True)
class EvalSplit:
    """One evaluated split: for each evaluated user (index `users` [Q] into the Sequences),
    its input `inputs` [Q, max_len] (`last_events` of its input events), its held-out item
    `targets` [Q], and `history_ends` [Q]: its input events are
    items[offsets[u]:history_ends], the items a full-catalogue ranking excludes."""

    users: np.ndarray
    inputs: np.ndarray
    targets: np.ndarray
    history_ends: np.ndarray


class LeaveOneOut:
    """The leave-one-out split of `seqs` (module docstring)."""

    def __init__(self, seqs: Sequences) -> None:
        self.seqs = seqs
        lengths = seqs.lengths()
        self.evaluated = np.flatnonzero(lengths >= 3)  # user indices with val and test
        # train events of each user: all but the last two, or all under 3 events
        self.train_ends = seqs.offsets[1:] - np.where(lengths >= 3, 2, 0)

    def train_windows(self, max_len: int) -> np.ndarray:
        """[U_train, max_len + 1]: each user's most recent max_len + 1 train events, for users
        with at least 2 (an input and a next item): inputs = [:, :max_len], next-item targets
        = [:, 1:] (a position whose target is PAD trains nothing)."""
        starts = self.seqs.offsets[:-1]
        keep = self.train_ends - starts >= 2
        return last_events(starts[keep], self.train_ends[keep], self.seqs.items, max_len + 1)

    def train_users(self) -> np.ndarray:
        """User indices of `train_windows`' rows."""
        return np.flatnonzero(self.train_ends - self.seqs.offsets[:-1] >= 2)

    def eval_split(self, split: str, max_len: int) -> EvalSplit:
        """The evaluated users' inputs and held-out items of `split` (val or test)."""
        if split not in SPLITS:
            raise ValueError(f"leave-one-out: split {split!r} is not one of {SPLITS}")
        users = self.evaluated
        held = self.seqs.offsets[users + 1] - (2 if split == "val" else 1)
        starts = self.seqs.offsets[users]
        inputs = last_events(starts, held, self.seqs.items, max_len)
        return EvalSplit(users, inputs, self.seqs.items[held], held)

    def history(self, u: int) -> np.ndarray:
        """User index u's every event (train, val and test): what sampled negatives avoid."""
        return self.seqs.of(u)
