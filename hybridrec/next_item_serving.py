"""Serving a next-item model (model.task=next_item): what hybridrec.inference.NextItemExport
does beyond InferenceModel, kept here so that module stays small (it mixes NextItemServing in;
this module never imports it).

    model = load_export("model.pt")                          # a NextItemExport
    items, scores = model.topk([[3, 17, 9], [42]], k=10)     # ids [Q, 10], scores [Q, 10]
    states = model.query([[3, 17, 9], [42]])                 # [Q, D] the user encoder's output
    model.item_ids, model.item_vectors                       # [N], [N, D]: the catalogue

**Item ids are the data file's.** The item table's row r is item `item_base + r` of the data
the model was trained on (data=sequences: the `user item` format's 1-based item i is row i - 1,
so item_base = 1; an interaction table's item is row item - data.sequence.item_base). The
export records each row's id (`item_ids` [N] = item_base + 0..N-1, every row of the item
table: the catalogue the trainer's evaluation ranks), so histories, `exclude`, `items` and
the returned lists all hold the file's own ids. `forward` and `predict` alone take the
trainer's batch layout of rows (InferenceModel's contract).

**Histories** (`histories`): a list of Q item-id lists, oldest event first, any length (the
model reads the most recent max_len: the trainer's truncation), or an int tensor [Q, W]
holding each history's ids first and -1 after them. An empty history, an id outside the
catalogue, a non-integer id or a -1 before an id is refused with PredictInputError, one
line naming the history and the id.

**topk** equals the trainer's evaluation (hybridrec.train.next_item_eval): the user's state
after its last event (the model's `query`) scores every item vector, higher first, equal
scores by lower item id, -1 (score -inf) past the items left; by default each history's
items are left out (`exclude="history"`, as the evaluation leaves out a user's input
events: all of them, not only the most recent max_len), `exclude=None` leaves none out,
and one list of item ids per history leaves those out.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hybridrec.serving import (
    SCORES_PER_BLOCK,
    PredictInputError,
    check_k,
    decode,
    excluded_positions,
    rank,
)
from hybridrec.types import PAD_ID, KeyedIds

SEQ = "seq"  # the feature holding a user's events (hybridrec.data.sequence_source)
USERS_PER_QUERY = 1024  # histories encoded at once (the encoder's memory: users x L x D)


def _integer(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _integer_array(x: torch.Tensor | np.ndarray) -> bool:
    dtype = x.dtype
    if isinstance(x, np.ndarray):
        return np.issubdtype(dtype, np.integer)
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def history_lists(histories: object) -> list[torch.Tensor]:
    """Each history's item ids (int64 [n], oldest first) of `histories` (module docstring);
    PredictInputError for anything but a list of integer lists or an integer tensor [Q, W]
    padded with -1 after each history's ids."""
    if isinstance(histories, (torch.Tensor, np.ndarray)):
        if histories.ndim != 2 or not _integer_array(histories):
            raise PredictInputError(
                f"histories must be an integer tensor [users, events] padded with -1, or a "
                f"list of item-id lists; got {histories.dtype} {list(histories.shape)}"
            )
        rows = torch.as_tensor(histories).long().cpu()
        out = []
        for q, row in enumerate(rows):
            pad = (row == PAD_ID).nonzero()
            cut = int(pad[0]) if len(pad) else len(row)
            after = row[cut:] != PAD_ID
            if bool(after.any()):
                col = cut + int(after.nonzero()[0])
                raise PredictInputError(
                    f"histories[{q}]: item id {int(row[col])} at column {col} comes after a -1 "
                    f"at column {cut}; a padded history holds its ids first, then -1"
                )
            out.append(row[:cut])
        return out
    if isinstance(histories, (str, bytes)) or not isinstance(histories, Sequence):
        raise PredictInputError(
            "histories must be a list of item-id lists (oldest first) or an integer tensor "
            f"[users, events] padded with -1; got {type(histories).__name__}"
        )
    out = []
    for q, h in enumerate(histories):
        if isinstance(h, (torch.Tensor, np.ndarray)):
            if h.ndim != 1 or not _integer_array(h):
                raise PredictInputError(
                    f"histories[{q}] must be a list of item ids (integers), got {h.dtype} "
                    f"{list(h.shape)}"
                )
            out.append(torch.as_tensor(h).long().cpu())
            continue
        if isinstance(h, (str, bytes)) or not isinstance(h, Sequence):
            raise PredictInputError(
                f"histories[{q}] must be a list of item ids (oldest first), got {type(h).__name__}"
            )
        bad = next((x for x in h if not _integer(x)), None)
        if bad is not None:
            raise PredictInputError(
                f"histories[{q}]: {bad!r} is not an item id (item ids are integers)"
            )
        out.append(torch.tensor([int(x) for x in h], dtype=torch.int64))
    return out


def history_rows(histories: object, item_ids: torch.Tensor) -> list[torch.Tensor]:
    """Each history's item rows (int64 [n] in [0, N), oldest first) of `histories`, whose
    ids are those of `item_ids` [N] (consecutive: row r is item item_ids[0] + r).
    PredictInputError for an empty history or an id outside the catalogue."""
    base, n = int(item_ids[0]), len(item_ids)
    out = []
    for q, ids in enumerate(history_lists(histories)):
        if not len(ids):
            raise PredictInputError(
                f"histories[{q}] is empty: a next-item model ranks the items that follow a "
                "user's events; serve a user without events another way (popular items)"
            )
        rows = ids - base
        bad = (rows < 0) | (rows >= n)
        if bool(bad.any()):
            raise PredictInputError(
                f"histories[{q}]: item id {int(ids[bad][0])} is not in the catalogue (item ids "
                f"{base}..{base + n - 1}, as the data file numbers them)"
            )
        out.append(rows)
    return out


def last_events(rows: list[torch.Tensor], max_len: int) -> torch.Tensor:
    """[Q, max_len] int64: each history's most recent max_len rows, left-aligned, -1 after
    (the trainer's layout of a user's input: hybridrec.data.sequences.last_events)."""
    out = torch.full((len(rows), max_len), PAD_ID, dtype=torch.int64)
    for q, r in enumerate(rows):
        kept = r[-max_len:]
        out[q, : len(kept)] = kept
    return out


def excluded_rows(
    exclude: object, rows: list[torch.Tensor], item_ids: torch.Tensor
) -> list[torch.Tensor] | None:
    """Per history, the catalogue rows top-K leaves out: "history" its own items, None
    none, or one list of item ids per history (ids outside the catalogue ignored)."""
    if isinstance(exclude, str):
        if exclude != "history":
            raise PredictInputError(
                f"exclude must be 'history' (each history's items: the default), None, or "
                f"one list of item ids per history; got {exclude!r}"
            )
        return [r.unique() for r in rows]
    return excluded_positions(exclude, len(rows), item_ids)  # type: ignore[arg-type]


def item_rows(items: object, users: int, item_ids: torch.Tensor) -> torch.Tensor:
    """[Q, m] item rows of `items`: item ids [Q, m] (one list per history, of one length;
    a tensor or lists). PredictInputError for another shape or an id outside the catalogue."""
    base, n = int(item_ids[0]), len(item_ids)
    try:
        ids = torch.as_tensor(items).cpu()
    except (TypeError, ValueError, RuntimeError):
        ids = None
    if ids is None or ids.dim() != 2 or ids.shape[0] != users or not _integer_array(ids):
        got = f"{ids.dtype} {list(ids.shape)}" if ids is not None else type(items).__name__
        raise PredictInputError(
            f"items must be item ids [{users}, m] (one list per history, of one length), got {got}"
        )
    rows = ids.long() - base
    bad = (rows < 0) | (rows >= n)
    if bool(bad.any()):
        q, j = (int(v) for v in bad.nonzero()[0])
        raise PredictInputError(
            f"items[{q}][{j}]: item id {int(ids[q, j])} is not in the catalogue (item ids "
            f"{base}..{base + n - 1})"
        )
    return rows


def check_catalogue(
    path: object, ids: object, vectors: object, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """An export's catalogue (item ids, item vectors) as NextItemServing reads it: ids int64
    [rows] (item_base + 0..rows-1: a row per item of the item table, `rows` of them), vectors
    float32 [rows, D], finite. ValueError naming `path` otherwise (the file is data: a
    catalogue that does not fit is refused, never guessed)."""
    where = f"{path}: its next-item catalogue"
    if not isinstance(ids, torch.Tensor) or not isinstance(vectors, torch.Tensor):
        raise ValueError(f"{where} needs item ids and item vectors, both tensors")
    if (
        ids.shape != (rows,)
        or not _integer_array(ids)
        or (rows and not torch.equal(ids.long(), torch.arange(rows) + int(ids[0])))
    ):
        raise ValueError(
            f"{where}: item ids {ids.dtype} {list(ids.shape)} are not the item table's {rows} "
            "rows numbered from one first id; write the export again with hybridrec-export"
        )
    if vectors.dim() != 2 or vectors.shape[0] != rows or not vectors.is_floating_point():
        raise ValueError(
            f"{where}: item vectors {vectors.dtype} {list(vectors.shape)} are not [{rows}, D] "
            "floats; write the export again with hybridrec-export"
        )
    if not bool(torch.isfinite(vectors).all()):
        raise ValueError(f"{where}: item vectors hold NaN or inf (a diverged model)")
    return ids.long(), vectors.float()


class NextItemServing:
    """The methods of hybridrec.inference.NextItemExport (module docstring), over
    InferenceModel's `net`, `names`, `hotness`, `offsets` and `num_dense`. The net offers
    what the trainer's evaluation reads (NextItemModel does): `net.query(dense, ids)` ->
    [B, D] each user's state after the events in `seq`'s positions 0..max_len-1,
    `net.candidates(item rows)` -> [n, D], `net.max_len`.
    `item_ids` [N] (ascending, consecutive) and `item_vectors` [N, D]: the catalogue, from
    the export (load_export), None in a file without one."""

    item_ids: torch.Tensor | None = None
    item_vectors: torch.Tensor | None = None
    net: Any
    names: tuple[str, ...]
    hotness: tuple[int, ...]
    offsets: list[int]
    num_dense: int

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        missing = [a for a in ("query", "candidates", "max_len") if not hasattr(self.net, a)]
        if missing or SEQ not in self.names:
            raise ValueError(
                f"a next-item export needs a model with query, candidates and max_len and a "
                f"feature {SEQ!r} (what the trainer's next-item evaluation reads); "
                f"{type(self.net).__name__} lacks {missing or [SEQ]}"
            )
        self.max_len = int(self.net.max_len)
        self.seq_column = self.offsets[self.names.index(SEQ)]

    @property
    def item_base(self) -> int | None:
        """The data file's id of item row 0 (None without a catalogue)."""
        return None if self.item_ids is None else int(self.item_ids[0])

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[B] scores in the trainer's batch layout (item rows): the state after the events
        in `seq`'s positions 0..max_len-1 against the item row in position max_len."""
        keyed = KeyedIds(ids.long(), self.names, self.hotness)
        item = ids[:, self.seq_column + self.max_len].long()
        return (self.net.query(dense, keyed) * self.net.candidates(item)).sum(1).float()

    def check_inputs(self, dense: torch.Tensor, ids: torch.Tensor) -> None:
        """InferenceModel's checks, and `seq` as forward reads it: events first from
        position 0, then -1, and an item row in position max_len."""
        super().check_inputs(dense, ids)  # type: ignore[misc]
        seq = ids[:, self.seq_column : self.seq_column + self.max_len + 1].cpu()
        events, item = seq[:, :-1] >= 0, seq[:, -1]
        hole = ~events[:, :-1] & events[:, 1:]
        for bad, what in (
            (~events[:, 0], "no event in position 0"),
            (hole.any(1), "a -1 before an event (events come first, then -1)"),
            (item < 0, f"no item to score in position {self.max_len}"),
        ):
            if bool(bad.any()):
                raise PredictInputError(
                    f"row {int(bad.nonzero()[0])}: feature {SEQ!r} has {what}; forward scores "
                    f"the item in position {self.max_len} after the events before it"
                )

    def catalogue(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(item_ids [N], item_vectors [N, D]); ValueError when the export has none."""
        if self.item_ids is None or self.item_vectors is None:
            raise ValueError(
                "this export has no item vectors: write it again with hybridrec-export (a "
                "model.task=next_item checkpoint's export holds them)"
            )
        return self.item_ids, self.item_vectors

    def _device(self) -> torch.device:
        first = next(itertools.chain(self.net.parameters(), self.net.buffers()), None)
        return torch.device("cpu") if first is None else first.device

    @torch.no_grad()
    def states(self, inputs: torch.Tensor) -> torch.Tensor:
        """[Q, D] float32: the model's state after each input (item rows [Q, max_len], -1
        after the events), USERS_PER_QUERY users per lookup."""
        self.eval()  # type: ignore[attr-defined]
        device, width = self._device(), self.offsets[-1]
        parts = []
        for a in range(0, len(inputs), USERS_PER_QUERY):
            part = inputs[a : a + USERS_PER_QUERY]
            ids = torch.full((len(part), width), PAD_ID, dtype=torch.int64)
            ids[:, self.seq_column : self.seq_column + self.max_len] = part
            keyed = KeyedIds(ids.to(device), self.names, self.hotness)
            dense = torch.zeros(len(part), self.num_dense, device=device)
            parts.append(self.net.query(dense, keyed).float())
        return torch.cat(parts) if parts else torch.zeros(0, self.catalogue()[1].shape[1])

    @torch.no_grad()
    def query(self, histories: object) -> torch.Tensor:
        """[Q, D]: each history's user state (the user encoder's output: what an ANN index
        is searched with, against `item_vectors`)."""
        ids, _ = self.catalogue()
        return self.states(last_events(history_rows(histories, ids), self.max_len))

    @torch.no_grad()
    def topk(
        self,
        histories: object,
        k: int,
        exclude: object = "history",
        *,
        batch: int = SCORES_PER_BLOCK,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(item ids [Q, k], scores [Q, k]): the k best items after each history, in the
        trainer's evaluation order (module docstring); `batch`: (user, item) dot products
        computed at once."""
        k = check_k(k)
        ids, vectors = self.catalogue()
        rows = history_rows(histories, ids)
        off = excluded_rows(exclude, rows, ids)
        q = self.states(last_events(rows, self.max_len))
        v = vectors.to(q.device)

        def score(a: int, b: int, pos: torch.Tensor) -> torch.Tensor:
            return q[a:b] @ v[pos.to(q.device)].T

        keys = rank(score, len(rows), len(ids), k, off, batch)
        return decode(keys, ids)

    @torch.no_grad()
    def score(self, histories: object, items: object) -> torch.Tensor:
        """[Q, m]: the scores topk ranks by, of items [Q, m] (item ids, one list per
        history) after each history."""
        ids, vectors = self.catalogue()
        rows = history_rows(histories, ids)
        q = self.states(last_events(rows, self.max_len))
        cand = vectors.to(q.device)[item_rows(items, len(rows), ids).to(q.device)]
        return torch.einsum("qd,qmd->qm", q, cand)
