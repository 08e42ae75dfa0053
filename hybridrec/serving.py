"""What an exported model needs to take raw inputs and to rank a catalogue (hybridrec.inference).

`hybridrec-export` records, from the dataset the model was trained on (its manifest.json and
counts/, read at export time by `record_dataset`), two things in the export:

- `data.dense_transforms` (JSON): each dense column's transform as preprocessing applied it:
  `none`, `log1p` (log(1 + max(x, 0))) or `standardize` ((x - train mean) / train std), a null
  or NaN read as 0 first. `DenseTransforms.apply` repeats it, so a caller passes raw values
  (`raw=True` in hybridrec.inference) and the export applies the dataset's own statistics;
- `data.trained.<feature>` (bool [rows], fixed tables): whether any train row of the dataset
  holds each id of the feature (its train counts). Training updates exactly those rows; any
  other row still holds its random initial vector, and a top-K list ranked for it would be
  noise. A dynamic table needs no record: its map (the export's slot ids) holds the ids it
  trained, and an id outside it has no row of its own.

`rank` is the one top-K loop of exports: every (row, catalogue item) pair scored by a
callback in blocks of at most `batch` pairs, a running top-K of int64 keys
(hybridrec.model.retrieval.order_keys: higher score first, equal scores by lower item id,
the trainer's evaluation order), excluded pairs never returned, -1 (score -inf) past the
items left. The keys hold catalogue positions, not ids, so any int64 id (a dynamic table's
raw ids) ranks the same way: the catalogue is sorted, so a lower position is a lower id.

Torch and numpy only, and the dataset manifest's reader: no storage, no trainer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridrec.data.manifest import Manifest
from hybridrec.model.retrieval import NO_ITEM, decode_keys, order_keys, top_keys
from hybridrec.types import TableConfig

TRANSFORMS_KEY = "data.dense_transforms"  # JSON, in an export
TRAINED_PREFIX = "data.trained."  # + feature name: bool [rows], in an export
UNTRAINED = ("refuse", "empty", "score")  # what top-K does with a row holding an untrained id
KINDS = ("none", "log1p", "standardize")
PAIRS_PER_BLOCK = 1 << 16  # (row, item) pairs a ranking model's forward scores at once
SCORES_PER_BLOCK = 1 << 24  # dot products a retrieval export scores at once (as evaluation)


class PredictInputError(ValueError):
    """Inputs an export cannot score: the message names the table or feature and the row."""


@dataclass(frozen=True)
class DenseTransforms:
    """The dataset's dense transforms, one per dense column (module docstring)."""

    columns: tuple[str, ...]
    kinds: tuple[str, ...]
    means: tuple[float, ...]
    stds: tuple[float, ...]

    def to_json(self) -> str:
        cols = zip(self.columns, self.kinds, self.means, self.stds, strict=True)
        return json.dumps(
            [{"column": c, "transform": k, "mean": m, "std": s} for c, k, m, s in cols]
        )

    @classmethod
    def from_json(cls, text: object, where: str) -> DenseTransforms:
        """Parsed and checked; ValueError naming `where` for anything but the list to_json
        writes (the file is data: a bad entry is refused, never guessed)."""
        try:
            items = json.loads(text) if isinstance(text, str) else None
            ok = isinstance(items, list) and all(
                isinstance(d, dict)
                and d.get("transform") in KINDS
                and all(isinstance(d.get(k), (int, float)) for k in ("mean", "std"))
                and math.isfinite(d["mean"])
                and math.isfinite(d["std"])
                for d in items
            )
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise ValueError(f"{where}: {TRANSFORMS_KEY} is not a list of dense transforms")
        return cls(
            tuple(str(d.get("column", i)) for i, d in enumerate(items)),
            tuple(d["transform"] for d in items),
            tuple(float(d["mean"]) for d in items),
            tuple(float(d["std"]) for d in items),
        )

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw dense values [B, F] (float; NaN: a missing value) -> [B, F] float32, as
        preprocessing stored them: null -> 0, then each column's transform, computed in
        float64 as preprocessing does (pass float64 values for the exact stored numbers).
        PredictInputError for a shape that does not fit or an infinite value."""
        if not isinstance(raw, torch.Tensor) or raw.dim() != 2 or not raw.is_floating_point():
            got = f"{raw.dtype} {list(raw.shape)}" if isinstance(raw, torch.Tensor) else type(raw)
            raise PredictInputError(
                f"raw dense values must be a float tensor [batch, {len(self.kinds)}] (columns "
                f"{list(self.columns)}), got {got}"
            )
        if raw.shape[1] != len(self.kinds):
            raise PredictInputError(
                f"raw dense values must be [batch, {len(self.kinds)}] (columns "
                f"{list(self.columns)}), got {list(raw.shape)}"
            )
        x = raw.detach().to("cpu", torch.float64)
        inf = torch.isinf(x)
        if bool(inf.any()):
            row, col = (int(v) for v in inf.nonzero()[0])
            raise PredictInputError(
                f"raw dense column {self.columns[col]!r}: {float(x[row, col])} at row {row} is "
                "infinite; give a finite number, or NaN for a missing value"
            )
        x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
        out = torch.empty_like(x)
        for j, (kind, mean, std) in enumerate(zip(self.kinds, self.means, self.stds, strict=True)):
            if kind == "log1p":
                out[:, j] = torch.log1p(x[:, j].clamp_min(0.0))
            elif kind == "standardize":
                out[:, j] = (x[:, j] - mean) / (std if std > 0 else 1.0)
            else:
                out[:, j] = x[:, j]
        return out.float().to(raw.device)


def dense_transforms(m: Manifest) -> DenseTransforms | None:
    """A dataset's dense transforms from its manifest: a spec dataset's per column
    (schema.dense.columns), Criteo's log1p of every column; None when the manifest says
    neither."""
    dense = (m.schema or {}).get("dense") or {}
    cols = dense.get("columns")
    if isinstance(cols, list):
        return DenseTransforms(
            tuple(str(c["column"]) for c in cols),
            tuple(str(c["transform"]) for c in cols),
            tuple(float(c.get("train_mean", 0.0)) for c in cols),
            tuple(float(c.get("train_std", 1.0)) for c in cols),
        )
    fields = dense.get("fields")
    if m.spec is None and isinstance(fields, list):
        if str(m.transforms.get("dense", "")).startswith("log(1 + max(x, 0))"):
            n = len(fields)
            return DenseTransforms(tuple(fields), ("log1p",) * n, (0.0,) * n, (1.0,) * n)
    return None


def record_dataset(
    path: str | Path, features: Sequence[TableConfig], num_dense: int
) -> dict[str, Any]:
    """The export entries recording dataset `path` for a model of `features` (the model
    config's, in order) and `num_dense` dense inputs (module docstring). ValueError (one
    line naming `path`) when the dataset is not one the model was trained on: other
    features, more ids than a table's rows, other dense columns. A feature whose ids per
    sample differ from the dataset's (data.multi_hot=synthetic expands one-hot ids into
    bags while loading) gets no record of its trained rows: they are not the dataset's."""
    m = Manifest.load(path)
    names = [str(f["name"]) for f in m.features] if m.features else [t.name for t in m.tables]
    mine = [f.name for f in features]
    where = f"dataset {path} is not the one the model was trained on"
    if names != mine:
        raise ValueError(f"{where}: its features are {names}, the model's {mine}")
    for f, t in zip(features, m.tables, strict=True):
        if f.dynamic is None and t.num_embeddings > f.num_rows:
            raise ValueError(
                f"{where}: feature {f.name!r} has ids up to {t.num_embeddings - 1} there, the "
                f"model's table {f.num_rows} rows"
            )
    out: dict[str, Any] = {}
    dense = dense_transforms(m)
    if dense is not None:
        if len(dense.kinds) != num_dense:
            raise ValueError(
                f"{where}: it has {len(dense.kinds)} dense columns, the model {num_dense}"
            )
        out[TRANSFORMS_KEY] = dense.to_json()
    for i, (f, t, hot) in enumerate(zip(features, m.tables, m.hotness, strict=True)):
        dynamic = f.dynamic is not None or (m.features and m.features[i].get("dynamic"))
        counts = None if dynamic or hot != f.hotness else _train_counts(Path(path), t.counts_file)
        if counts is not None:
            ids, n = counts
            mask = torch.zeros(f.num_rows, dtype=torch.bool)
            mask[torch.from_numpy(ids[n > 0].astype(np.int64))] = True
            out[TRAINED_PREFIX + f.name] = mask
    return out


def _train_counts(root: Path, rel: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids, train counts) of a counts file, None when there is none; read as data only."""
    if not rel or not (root / rel).is_file():
        return None
    try:
        with np.load(root / rel, allow_pickle=False) as f:
            return np.asarray(f["ids"]), np.asarray(f["counts"])
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(
            f"{root / rel}: not the ids and counts hybridrec-preprocess writes ({e}); re-run "
            "hybridrec-preprocess"
        ) from None


def check_k(k: object) -> int:
    """`k` as the list length: a whole number >= 1 (PredictInputError otherwise). A k past
    the items left is padded with -1 (module docstring), never refused."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise PredictInputError(f"k must be a whole number >= 1 (items per list), got {k!r}")
    return int(k)


def check_untrained(untrained: object) -> str:
    if untrained not in UNTRAINED:
        raise PredictInputError(
            f"untrained must be one of {', '.join(map(repr, UNTRAINED))}, got {untrained!r}"
        )
    return str(untrained)


def excluded_positions(
    exclude: Sequence[Sequence[int]] | None, rows: int, catalogue: torch.Tensor
) -> list[torch.Tensor] | None:
    """Per request row, the catalogue positions of `exclude[row]`'s item ids (ids not in the
    catalogue are ignored: nothing to leave out). PredictInputError unless `exclude` has one
    list per row."""
    if exclude is None:
        return None
    if isinstance(exclude, (str, bytes, torch.Tensor)) or not isinstance(exclude, Sequence):
        raise PredictInputError(
            f"exclude must be a list of {rows} lists of item ids (one per row), got "
            f"{type(exclude).__name__}"
        )
    if len(exclude) != rows:
        raise PredictInputError(
            f"exclude has {len(exclude)} lists but the request has {rows} rows; give one list "
            "of item ids per row (an empty one for none)"
        )
    out = []
    for row, items in enumerate(exclude):
        try:
            ids = torch.as_tensor(list(items), dtype=torch.int64).view(-1)
        except (TypeError, ValueError, RuntimeError):
            raise PredictInputError(
                f"exclude[{row}] must be a list of item ids (ints), got {items!r:.60}"
            ) from None
        pos = torch.searchsorted(catalogue, ids).clamp_max(max(len(catalogue) - 1, 0))
        hit = catalogue[pos] == ids if len(catalogue) else torch.zeros_like(ids, dtype=torch.bool)
        out.append(pos[hit])
    return out


def untrained_rows(
    ids: torch.Tensor,
    features: Sequence[TableConfig],
    offsets: Sequence[int],
    checked: Sequence[int],
    has_row: Callable[[int], Callable[[torch.Tensor], torch.Tensor] | None],
) -> tuple[torch.Tensor, str | None]:
    """([B] bool: the rows of ids [B, H] holding an id without a trained row in one of the
    features `checked` (indexes into `features`), a description of the first such id).
    `has_row(i)`: feature i's test, ids -> bool of the same shape, or None when the export
    cannot tell (PredictInputError then, naming the feature and what to do)."""
    bad = torch.zeros(ids.shape[0], dtype=torch.bool)
    first: tuple[int, str] | None = None
    for i in checked:
        f = features[i]
        test = has_row(i)
        if test is None:
            raise PredictInputError(
                f"this export does not record which rows of feature {f.name!r} were trained "
                "(written without its dataset, or by an older hybridrec): write it again with "
                "hybridrec-export --data DIR, or pass untrained='score' to rank such rows as "
                "they are"
            )
        cols = ids[:, offsets[i] : offsets[i + 1]].long().cpu()
        present = cols >= 0  # -1: a list's padding, no id
        missing = present & ~test(cols.clamp_min(0))
        rows = missing.any(1)
        if bool(rows.any()):
            r = int(rows.nonzero()[0])
            c = int(missing[r].nonzero()[0])
            if first is None or r < first[0]:
                first = (r, f"row {r}: feature {f.name!r} id {int(cols[r, c])}")
            bad |= rows
    return bad, None if first is None else first[1]


def untrained_error(first: str) -> PredictInputError:
    return PredictInputError(
        f"{first} has no trained row (no train row of the dataset holds it: an id training "
        "never saw, or a null no train row had), so its list would come from a random vector; "
        "serve such rows another way (popular items), or pass untrained='empty' (an empty list "
        "for them) or untrained='score'"
    )


def rank(
    score: Callable[[int, int, torch.Tensor], torch.Tensor],
    rows: int,
    items: int,
    k: int,
    exclude: list[torch.Tensor] | None = None,
    batch: int = PAIRS_PER_BLOCK,
) -> torch.Tensor:
    """Top-k keys [rows, k] of catalogue positions (module docstring): `score(a, b, pos)`
    gives the scores [b - a, len(pos)] of request rows [a, b) against catalogue positions
    `pos`; at most `batch` pairs per call. `exclude[row]`: positions row must not get.
    PredictInputError for a NaN or infinite score (a diverged model)."""
    if batch < 1:
        raise PredictInputError(f"batch must be >= 1 (pairs scored at once), got {batch}")
    out = torch.full((rows, k), NO_ITEM, dtype=torch.int64)
    per = max(1, batch // max(items, 1))  # request rows per block
    chunk = max(1, batch // per)  # catalogue items per call
    for a in range(0, rows, per):
        b = min(a + per, rows)
        best = torch.full((b - a, 0), NO_ITEM, dtype=torch.int64)
        for lo in range(0, items, chunk):
            pos = torch.arange(lo, min(lo + chunk, items))
            scores = score(a, b, pos).float().cpu()
            bad = ~torch.isfinite(scores)
            if bool(bad.any()):
                r, c = (int(v) for v in bad.nonzero()[0])
                raise PredictInputError(
                    f"the model scores row {a + r} against catalogue item {int(pos[c])} as "
                    f"{float(scores[r, c])}: a diverged model, or inputs far outside training's"
                )
            keys = order_keys(scores, pos.unsqueeze(0))
            if exclude is not None:
                for r in range(a, b):
                    off = exclude[r]
                    off = off[(off >= lo) & (off < lo + len(pos))] - lo
                    keys[r - a, off] = NO_ITEM
            best = top_keys(torch.cat([best, keys], dim=1), k)
        out[a:b] = top_keys(best, k)
    return out


def decode(keys: torch.Tensor, catalogue: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(item ids [B, k], scores [B, k]) of `rank`'s keys: -1 and -inf where none is left."""
    pos, scores = decode_keys(keys)
    items = catalogue[pos.clamp_min(0)] if len(catalogue) else torch.zeros_like(pos)
    return items.masked_fill(pos < 0, -1), scores


def item_index(features: Sequence[TableConfig], name: str | None) -> int:
    """The index of item feature `name` (a feature of one id per sample) among `features`;
    PredictInputError naming the features otherwise."""
    names = [t.name for t in features]
    if name is None:
        raise PredictInputError(
            f"topk needs the feature whose ids are the items: topk(..., item_feature=...), "
            f"one of {names}"
        )
    if name not in names:
        raise PredictInputError(f"item_feature={name!r} is not a feature; the model's are {names}")
    i = names.index(name)
    if features[i].hotness != 1 or features[i].jagged:
        raise PredictInputError(
            f"item_feature={name!r} is a list feature ({features[i].hotness} ids per sample); "
            "the items of a top-K are one id per sample"
        )
    return i


def catalogue(
    f: TableConfig,
    items: object,
    untrained: str,
    has_row: Callable[[torch.Tensor], torch.Tensor] | None,
    held: torch.Tensor | None = None,
) -> torch.Tensor:
    """The item ids a ranking top-K scores, ascending and distinct, of item feature `f`:
    `items` as given (checked: ids of `f`; untrained ones refused or left out as `untrained`
    says), or by default every id `has_row` says has a trained row, of all of `f`'s rows
    (a fixed table) or of `held` (a dynamic table: the ids its map holds)."""
    if items is None:
        if has_row is None:
            raise PredictInputError(
                f"this export does not record which ids of item feature {f.name!r} were "
                "trained, so it has no catalogue: pass topk(..., items=<item ids>), or write "
                "it again with hybridrec-export --data DIR"
            )
        every = (torch.arange(f.num_rows) if held is None else held).unique()
        return every[has_row(every)]
    try:
        ids = torch.as_tensor(items, dtype=torch.int64).view(-1).unique()
    except (TypeError, ValueError, RuntimeError):
        raise PredictInputError(
            f"items must be a list of item ids (ints), got {items!r:.60}"
        ) from None
    raw = held is not None  # a dynamic table's ids: any id >= 0
    bad = (ids < 0) | ((ids >= f.num_rows) & (not raw))
    if bool(bad.any()):
        valid = "" if raw else f" (valid ids: 0..{f.num_rows - 1})"
        raise PredictInputError(
            f"items: id {int(ids[bad][0])} is not an id of item feature {f.name!r}{valid}"
        )
    if untrained == "score":
        return ids
    if has_row is None:
        raise PredictInputError(
            f"this export does not record which ids of item feature {f.name!r} were trained: "
            "pass untrained='score' to rank these items as they are, or write it again with "
            "hybridrec-export --data DIR"
        )
    ok = has_row(ids)
    if untrained == "refuse" and not bool(ok.all()):
        raise PredictInputError(
            f"items: id {int(ids[~ok][0])} of item feature {f.name!r} has no trained row (a "
            "random vector would rank it); leave it out, or pass untrained='empty' (untrained "
            "items left out) or untrained='score'"
        )
    return ids[ok]
