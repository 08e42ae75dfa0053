"""`data=sequences`: users' item sequences for next-item models (model.task=next_item).

`data.path` names either a `user item` file (one event per line, 1-based ids, a user's lines
contiguous and oldest first: what sequential-recommendation repositories ship) or an
interaction table (Parquet, or CSV with a header: one row per event, columns
`data.sequence.user`, `.item`, `.time`; a user's events ordered by time, equal times by item).
Both become per-user sequences split leave-one-out (hybridrec.data.sequences: the last event
is test, the one before val, the rest train; users with fewer than 3 events only train).

The batch's features (the model's tables; `sequence_model_keys` fills model.* with them before
validation, as data=table does from a manifest):

    seq  [L + 1]  a sequence (pooling none) of the item table: a user's most recent events,
                  left-aligned, -1 past its length. Training reads positions 0..L-1 and
                  predicts each one's next event (positions 1..L); evaluation reads the
                  split's input events in positions 0..L-1 (position L is -1).
    neg  [L * N]  (train.next_item.loss=bce) for each of the L positions that train (an
                  input event followed by a next one), N items drawn uniformly among those
                  the user has no train event of; -1 at the others (nothing to look up).

Training: an epoch is every user with at least 2 train events once, in an order drawn from
(seed, epoch); global batch s is positions [s*B, (s+1)*B) of that order (an epoch's last
partial batch is dropped, so every batch is whole and splits evenly over ranks). The
negatives of batch s are drawn from (seed, s) over the whole global batch, so any number of
ranks reads the same batch. The dense input is empty ([B, 0]) and labels are not read.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from hybridrec.config.schema import SEQUENCE_ARCHS
from hybridrec.data.loader import BatchSource
from hybridrec.data.sequences import LeaveOneOut, Sequences, read_interaction_table, read_user_item
from hybridrec.types import Batch

FORMATS = ("auto", "user_item", "table")
SEQUENCE_FEATURES = ("seq", "neg")  # the batch's features (module docstring)
ITEM_TABLE = "item"


def _format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    return "table" if path.suffix.lower() in (".parquet", ".csv", ".tsv") else "user_item"


def item_id_base(path: str | Path, fmt: str = "auto", item_base: int = 0) -> int:
    """The data file's id of item row 0 (data.path, data.sequence.format and .item_base): 1
    for a `user item` file (1-based ids: item i is row i - 1), `item_base` for an
    interaction table. What an export records, so serving takes the file's own ids."""
    return 1 if _format(Path(path), fmt) == "user_item" else int(item_base)


@functools.lru_cache(maxsize=4)
def _read(path: str, mtime: float, fmt: str, user: str, item: str, time: str, base: int):  # noqa: ANN202, ARG001 (mtime: the cache key)
    p = Path(path)
    if _format(p, fmt) == "user_item":
        return read_user_item(p)
    return read_interaction_table(p, user, item, time, item_base=base)


def read_sequences(data) -> Sequences:  # noqa: ANN001 - a DataConfig or its raw mapping
    """The sequences `data.path` holds (module docstring), read once per process. ValueError
    (one line) for a missing path or file, or a malformed line or row."""
    path = data.get("path") if hasattr(data, "get") else data.path
    if not path:
        raise ValueError(
            "data=sequences needs data.path: a `user item` file or an interaction table "
            "(Parquet or CSV with user, item and time columns)"
        )
    p = Path(str(path)).expanduser()
    if not p.is_file():
        raise ValueError(f"data.path={p}: no such file (data=sequences reads one file)")
    seq = data.get("sequence") if hasattr(data, "get") else data.sequence
    seq = seq if seq is not None else {}
    get = seq.get if hasattr(seq, "get") else (lambda k, d: getattr(seq, k, d))
    fmt = str(get("format", "auto"))
    if fmt not in FORMATS:
        raise ValueError(f"data.sequence.format={fmt!r} is not one of: {', '.join(FORMATS)}")
    return _read(
        str(p.resolve()),
        os.path.getmtime(p),
        fmt,
        str(get("user", "user")),
        str(get("item", "item")),
        str(get("time", "timestamp")),
        int(get("item_base", 0)),
    )


def fill_model(raw: DictConfig) -> DictConfig:
    """`raw` with the model keys the sequences fix filled in (a copy), as data=table's
    manifest fills them: keys left null take the data's value; a key the user set must equal
    it (ValueError naming the key). model.task defaults to next_item."""
    raw = OmegaConf.create(OmegaConf.to_container(raw, resolve=False))
    data = raw.get("data")
    seq = data.get("sequence") or {}
    nxt = ((raw.get("train") or {}).get("next_item")) or {}
    negatives = int(nxt.get("negatives", 1)) if nxt.get("loss", "bce") == "bce" else 0
    keys = sequence_model_keys(read_sequences(data), int(seq.get("max_len", 50)), negatives)
    model = raw.get("model") or OmegaConf.create({})
    arch = model.get("arch", "dlrm")
    if model.get("_target_") is None and arch not in SEQUENCE_ARCHS:
        raise ValueError(
            f"data=sequences holds users' item sequences: train them with model=sasrec or "
            f"model=hstu (model.task=next_item), or your own model._target_, not "
            f"model.arch={arch}"
        )
    if model.get("task") is None:
        model["task"] = "next_item"
    for key, want in keys.items():
        given = model.get(key)
        given = OmegaConf.to_container(given) if OmegaConf.is_config(given) else given
        if given is None:
            model[key] = want
        elif given != want and not (key in ("pooling", "jagged") and [given] * len(want) == want):
            raise ValueError(
                f"model.{key}={given} contradicts data=sequences ({data.get('path')}): it has "
                f"{want}; leave model.{key} unset (the sequence models take it from the data)"
            )
    raw["model"] = model
    return raw


def sequence_model_keys(seqs: Sequences, max_len: int, negatives: int) -> dict[str, object]:
    """The model.* keys the data fixes: the features `seq` (and `neg` with negatives > 0),
    both sequences of the item table of `num_items` rows."""
    split = LeaveOneOut(seqs)
    windows = split.train_windows(max_len)
    mean = float((windows >= 0).sum(1).mean()) if len(windows) else float(max_len + 1)
    trains = float(((windows[:, :-1] >= 0) & (windows[:, 1:] >= 0)).sum(1).mean())
    names, hot, means = ["seq"], [max_len + 1], [mean]
    if negatives:  # the planner's estimates: ids per sample on average
        names.append("neg")
        hot.append(max_len * negatives)
        means.append(trains * negatives)
    n = len(names)
    return {
        "num_dense_features": 0,
        "feature_names": names,
        "table_names": [ITEM_TABLE] * n,
        "num_embeddings_per_feature": [seqs.num_items] * n,
        "hotness": hot,
        "pooling": ["none"] * n,
        "jagged": [True] * n,
        "mean_ids": means,
    }


class SequenceSource(BatchSource):
    """Global batches of users' sequences (module docstring)."""

    def __init__(self, seqs: Sequences, max_len: int, negatives: int, seed: int) -> None:
        if max_len < 1:
            raise ValueError(f"data.sequence.max_len must be >= 1, got {max_len}")
        self.seqs, self.max_len, self.negatives, self.seed = seqs, max_len, negatives, seed
        self.split = LeaveOneOut(seqs)
        self.windows = self.split.train_windows(max_len)  # [U, L + 1]
        self.train_users = self.split.train_users()
        if not len(self.windows):
            raise ValueError(
                "data=sequences: no user has 2 train events (an input and a next item); "
                "next-item training needs longer histories"
            )
        starts, lengths = seqs.offsets[:-1], self.split.train_ends - seqs.offsets[:-1]
        user = np.repeat(np.arange(len(seqs)), lengths)
        within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        train_items = seqs.items[np.repeat(starts, lengths) + within]
        # (user, item) of every train event, as sorted codes: what a negative may not be
        self._train_codes = np.unique(user * seqs.num_items + train_items)
        self._counts = np.bincount(train_items, minlength=seqs.num_items).astype(np.int64)
        self._orders: dict[int, np.ndarray] = {}

    @property
    def num_items(self) -> int:
        return self.seqs.num_items

    def steps_per_epoch(self, batch_size: int, split: str = "train") -> int | None:
        if split == "train":
            return len(self.windows) // batch_size
        return -(-len(self.split.evaluated) // batch_size)

    def split_rows(self, split: str) -> int | None:
        return len(self.windows) if split == "train" else len(self.split.evaluated)

    def id_counts(self, table_index: int) -> np.ndarray | None:
        """Train events per item (both features look the item table up)."""
        return self._counts

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            rng = np.random.default_rng([self.seed, epoch])
            self._orders = {epoch: rng.permutation(len(self.windows))}
        return self._orders[epoch]

    def batch(self, step: int, batch_size: int, split: str = "train") -> Batch:
        if split != "train":
            return self._eval_batch(step, batch_size, split)
        per_epoch = self.steps_per_epoch(batch_size)
        if not per_epoch:
            raise ValueError(
                f"train.batch_size={batch_size} is more than the {len(self.windows)} training "
                "sequences: lower it"
            )
        epoch, at = divmod(step, per_epoch)
        rows = self._order(epoch)[at * batch_size : (at + 1) * batch_size]
        seq = self.windows[rows]
        cols = [seq]
        if self.negatives:
            trains = (seq[:, :-1] >= 0) & (seq[:, 1:] >= 0)  # [B, L]
            neg = self._negatives(step, self.train_users[rows])
            neg = np.where(np.repeat(trains, self.negatives, axis=1), neg, -1)
            cols.append(neg)
        ids = torch.from_numpy(np.concatenate(cols, axis=1))
        return Batch(torch.zeros(batch_size, 0), ids, torch.zeros(batch_size))

    def _negatives(self, step: int, users: np.ndarray) -> np.ndarray:
        """[B, L * N] items each user has no train event of, uniform, drawn from (seed, step)."""
        rng = np.random.default_rng([self.seed, 1, step])
        shape = (len(users), self.max_len * self.negatives)
        out = rng.integers(0, self.num_items, size=shape)
        code_base = users[:, None] * self.num_items
        bad = self._seen(code_base + out)
        while bad.any():  # redraw the hits, in order (the same draws on every rank)
            out[bad] = rng.integers(0, self.num_items, size=int(bad.sum()))
            bad = self._seen(code_base + out)
        return out

    def _seen(self, codes: np.ndarray) -> np.ndarray:
        at = np.searchsorted(self._train_codes, codes).clip(max=len(self._train_codes) - 1)
        return self._train_codes[at] == codes

    def _eval_batch(self, step: int, batch_size: int, split: str) -> Batch:
        """The evaluated users' inputs of `split` (val or test), rows [step*B, (step+1)*B)
        (the last batch short): seq = the input's last L events, then -1."""
        ev = self.eval_split(split)
        rows = slice(step * batch_size, (step + 1) * batch_size)
        inputs = ev.inputs[rows]
        seq = np.concatenate([inputs, np.full((len(inputs), 1), -1)], axis=1)
        cols = [seq]
        if self.negatives:
            cols.append(np.full((len(inputs), self.max_len * self.negatives), -1))
        n = len(inputs)
        return Batch(torch.zeros(n, 0), torch.from_numpy(np.concatenate(cols, 1)), torch.zeros(n))

    @functools.lru_cache(maxsize=2)  # noqa: B019 (a source lives as long as its run)
    def eval_split(self, split: str):  # noqa: ANN201 - hybridrec.data.sequences.EvalSplit
        """The leave-one-out split `split` ("val" or "test", "eval" = val) of the evaluated
        users: their inputs [Q, L], held-out items [Q] and histories."""
        name = "val" if split == "eval" else split
        return self.split.eval_split(name, self.max_len)
