"""One sparse feature's encoding: raw values -> ids of its table, plus what the manifest reports.

Ids per encoding (docs/data-spec.md; every null value has an id of its own):
- vocabulary: 0 = null, 1 = out of vocabulary (unseen in train, or seen < min_count times),
  2.. = train values by decreasing train count (ties by value); rows = 2 + kept values.
- hashing: 0 = null, 1 + hash(value) mod (cap - 1) otherwise; rows = cap. Integers (and
  booleans) hash by splitmix64 of the int64, text by splitmix64 of the FNV-1a hash of its
  UTF-8 bytes, anything else by that of its Python repr (CSV values are text: 7 in a CSV
  hashes as "7").
- identity: the value itself, an integer in [0, rows); null = rows; the table has rows + 1.
- dynamic: the raw id, no vocabulary (`raw_ids`): an integer (or boolean) value itself, which
  must be in [0, 2^63 - 2); a string that is a plain decimal integer in that range (as CSV
  cells of integer ids are) the same integer; any other value the stable hash
  splitmix64(FNV-1a(UTF-8 text)) mod (2^63 - 2) (other types by their repr); null =
  DYNAMIC_NULL (2^63 - 2). So ids are int64 >= 0 and -1 stays the list padding. The table
  has `capacity` rows (slots), which the trainer maps ids to (hybridrec.sparse.dynamic).
Lists are bags of such ids padded with -1 to `max_len` (longer lists keep their first
max_len ids and are counted as truncated); a single feature is one id per row.
Features sharing a table (hybridrec.data.spec) encode alike, so one value is one row for all
of them: vocabulary features count into one `Vocabulary` (min_count on the combined counts),
and their values must be all text or all non-text (else one line naming both features).

Pass 1 (`count`) sees the train rows only: vocabulary counts, the longest train list. Pass 2
(`encode`) sees every row: ids, statistics, each id's train frequency (for counts/). Memory: a
vocabulary per table and a count per feature and table row, never the row count.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hybridrec.data.spec import MAX_LIST_LEN, DatasetSpec, SparseSpec, TableSpec
from hybridrec.data.tabular.columns import Bags, is_text, pad, where

_M = np.uint64(0xFFFFFFFFFFFFFFFF)
# encoding: dynamic's null id; no value hashes to it (2^63 - 1 the trainer's id check refuses)
DYNAMIC_NULL = 2**63 - 2
_PLAIN_INT = r"^(0|[1-9][0-9]{0,18})$"  # a decimal integer as CSV writes one: no sign, no 0s


def splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & _M


def text_hash(arr: pa.Array) -> np.ndarray:
    """[n] uint64: splitmix64 of the 64-bit FNV-1a of each string's UTF-8 bytes (no nulls),
    vectorised over the strings, one step per byte position."""
    n = len(arr)
    wide = pa.types.is_large_string(arr.type)
    itemsize = 8 if wide else 4
    offsets = np.frombuffer(
        arr.buffers()[1], np.int64 if wide else np.int32, n + 1, arr.offset * itemsize
    ).astype(np.int64)
    data = np.frombuffer(arr.buffers()[2], np.uint8) if n and offsets[-1] else np.zeros(1, np.uint8)
    lengths = np.diff(offsets)
    order = np.argsort(-lengths, kind="stable")  # the strings still going are a prefix
    starts, lens = offsets[:-1][order], lengths[order]
    h = np.full(n, 0xCBF29CE484222325, np.uint64)
    prime = np.uint64(0x100000001B3)
    with np.errstate(over="ignore"):
        for j in range(int(lens.max()) if n else 0):
            k = int(np.searchsorted(-lens, -j, side="left"))  # lens > j for the first k
            h[:k] = (h[:k] ^ data[starts[:k] + j]) * prime
    out = np.empty(n, np.uint64)
    out[order] = splitmix64(h)
    return out


def raw_ids(values: pa.Array) -> tuple[np.ndarray, int | None]:
    """encoding: dynamic's ids of flat `values` (the module docstring; a float that is a
    whole number is that integer): ([n] int64 in [0, 2^63 - 2], nulls = DYNAMIC_NULL; the
    index of the first negative or too large integer, or None). Stable across runs, processes
    and machines: pure integer arithmetic."""
    n, t = len(values), values.type
    if pa.types.is_dictionary(t):
        values, t = values.cast(t.value_type), t.value_type
    nulls = values.is_null().to_numpy(zero_copy_only=False)
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        if pa.types.is_uint64(t):  # beyond int64: out of range, reported below
            raw = pc.fill_null(values, 0).to_numpy(zero_copy_only=False)
            bad = raw >= np.uint64(DYNAMIC_NULL)
            ids = np.where(bad, 0, raw).astype(np.int64)
        else:
            ids = pc.fill_null(pc.cast(values, pa.int64()), 0).to_numpy(zero_copy_only=False)
            ids = ids.astype(np.int64, copy=True)
            bad = (ids < 0) | (ids >= DYNAMIC_NULL)
        bad &= ~nulls
        ids[nulls] = DYNAMIC_NULL
        return ids, (int(bad.argmax()) if bad.any() else None)
    ids = np.full(n, DYNAMIC_NULL, np.int64)
    if n == 0:
        return ids, None
    text = (
        values
        if is_text(t)
        else pa.array([None if v is None else repr(v) for v in values.to_pylist()], pa.string())
    )
    enc = text.dictionary_encode()
    words = enc.dictionary
    h = text_hash(words) % np.uint64(DYNAMIC_NULL)
    plain = pc.fill_null(pc.match_substring_regex(words, _PLAIN_INT), False)
    plain = plain.to_numpy(zero_copy_only=False) if is_text(t) else np.zeros(len(words), bool)
    if plain.any():
        as_int = pc.cast(words.filter(pa.array(plain)), pa.uint64()).to_numpy(zero_copy_only=False)
        fits = as_int < np.uint64(DYNAMIC_NULL)
        sel = np.flatnonzero(plain)[fits]
        h[sel] = as_int[fits]
    table = h.astype(np.int64)
    idx = enc.indices.to_numpy(zero_copy_only=False)
    ids[~nulls] = table[idx[~nulls].astype(np.int64)]
    if pa.types.is_floating(t):  # 5.0 (an integer column with nulls, from pandas) is 5
        f = pc.fill_null(values, -1.0).to_numpy(zero_copy_only=False).astype(np.float64)
        whole = (f == np.floor(f)) & (f >= 0) & (f < 2.0**62) & ~nulls
        ids[whole] = f[whole].astype(np.int64)
    return ids, None


class Vocabulary:
    """One table's vocabulary over the train values of every feature using it: ids 2.. by
    decreasing count (ties by value) for values counted at least `min_count` times."""

    def __init__(self, min_count: int) -> None:
        self.min_count = min_count
        self.counts: dict = {}  # pass 1: value -> train count
        self.ids: dict | None = None  # after `finish`
        self.distinct = 0  # distinct non-null train values

    def add(self, values: pa.Array) -> None:
        vc = pc.value_counts(values)
        for v, c in zip(
            vc.field("values").to_pylist(), vc.field("counts").to_pylist(), strict=True
        ):
            if v is not None:
                self.counts[v] = self.counts.get(v, 0) + c

    def finish(self) -> dict:
        """The value -> id mapping, fixed on the first call (the counts are then dropped)."""
        if self.ids is None:
            kept = sorted(
                (v for v, c in self.counts.items() if c >= self.min_count),
                key=lambda v: (-self.counts[v], v),
            )
            self.ids = {v: i + 2 for i, v in enumerate(kept)}
            self.distinct, self.counts = len(self.counts), {}
        return self.ids


class Feature:
    """One sparse feature through both passes (see the module docstring)."""

    def __init__(
        self,
        spec: SparseSpec,
        index: int,
        table: TableSpec,
        vocabulary: Vocabulary | None = None,
        shared_with: tuple[str, ...] = (),
    ) -> None:
        self.spec, self.index, self.table = spec, index, table
        self.shared_with = shared_with  # the other features of its table
        self.key = f"sparse[{index}] ({spec.name})"
        if spec.encoding == "vocabulary" and vocabulary is None:
            vocabulary = Vocabulary(spec.min_count)
        self.vocabulary = vocabulary
        self.train_max_len = 0
        self.value_type = ""
        self.vocab: dict = {}
        self.num_embeddings = 0
        self.max_len = 1
        # pass 2 statistics
        self.rows = self.nulls = self.truncated = self.len_sum = 0
        self.len_min, self.len_max = None, 0
        self.id_counts: np.ndarray | None = None
        self.raw_counts: tuple[np.ndarray, np.ndarray] | None = None  # dynamic: (ids, counts)

    # -- pass 1 ---------------------------------------------------------------------------
    def count(self, b: Bags, train: np.ndarray) -> None:
        """Train statistics of one batch (`train` [n] bool marks its train rows)."""
        self.value_type = self.value_type or str(b.values.type)
        lengths = b.lengths()
        if self.spec.kind == "list" and train.any():
            self.train_max_len = max(self.train_max_len, int(lengths[train].max()))
        if self.vocabulary is None or not train.any():
            return
        self.vocabulary.add(b.values.filter(pa.array(np.repeat(train, lengths))))

    def finish_counting(self) -> None:
        """Fix the vocabulary, the table's rows and max_len (after pass 1)."""
        s = self.spec
        if self.vocabulary is not None:
            self.vocab = self.vocabulary.finish()
            need = 2 + len(self.vocab)
        elif s.encoding == "dynamic":
            need = s.capacity
        else:
            need = s.cap if s.encoding == "hashing" else s.rows + 1
        if self.table.rows is not None and self.table.rows < need:
            who = ", ".join((s.name, *self.shared_with))
            raise ValueError(
                f"tables: {self.table.name}.rows={self.table.rows} is too small: "
                f"{'features' if self.shared_with else 'feature'} {who} ({s.encoding}) "
                f"{'need' if self.shared_with else 'needs'} {need} rows; raise it or leave it out"
            )
        self.num_embeddings = self.table.rows or need
        if s.kind == "list":
            self.max_len = s.max_len or max(1, min(self.train_max_len, MAX_LIST_LEN))
        if s.encoding == "dynamic":  # raw ids: distinct train ids and their counts
            self.raw_counts = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        else:
            self.id_counts = np.zeros(self.num_embeddings, np.int64)

    # -- pass 2 ---------------------------------------------------------------------------
    def _ids(self, values: pa.Array, b: Bags, file: str, row0: int) -> np.ndarray:
        """int64 ids [m] of `values` (the bag values, flattened)."""
        s, n = self.spec, len(values)
        if n == 0:
            return np.zeros(0, np.int64)
        if s.encoding == "identity":
            return self._identity(values, b, file, row0)
        if s.encoding == "dynamic":
            ids, bad = raw_ids(values)
            if bad is not None:
                raise ValueError(
                    f"{self.key}: column {s.column!r} holds id {values[bad].as_py()} at "
                    f"{where(file, row0, int(b.rows_of(np.array([bad]))[0]))}; encoding: dynamic "
                    f"takes integer ids in [0, 2^63 - 2): map the column's values into that "
                    "range, or give them as strings (which are hashed)"
                )
            return ids
        nulls = values.is_null().to_numpy(zero_copy_only=False)
        t = values.type
        if s.encoding == "hashing" and (pa.types.is_integer(t) or pa.types.is_boolean(t)):
            raw = pc.fill_null(pc.cast(values, pa.int64()), 0).to_numpy(zero_copy_only=False)
            ids = (1 + splitmix64(raw.view(np.uint64)) % np.uint64(s.cap - 1)).astype(np.int64)
        else:
            enc = values.dictionary_encode()
            words = enc.dictionary
            if s.encoding == "vocabulary":
                table = np.array([self.vocab.get(u, 1) for u in words.to_pylist()] + [0], np.int64)
            else:
                if not is_text(words.type):
                    words = pa.array([repr(u) for u in words.to_pylist()], pa.string())
                h = np.append(text_hash(words), np.uint64(0))
                table = (1 + h % np.uint64(s.cap - 1)).astype(np.int64)
            idx = pc.fill_null(enc.indices, len(words)).to_numpy(zero_copy_only=False)
            ids = table[idx]
        ids[nulls] = 0
        return ids

    def _identity(self, values: pa.Array, b: Bags, file: str, row0: int) -> np.ndarray:
        s, t = self.spec, values.type
        nulls = values.is_null().to_numpy(zero_copy_only=False)
        bad_what = None
        if is_text(t):
            try:
                ints = pc.cast(values, pa.int64())
            except pa.ArrowInvalid:
                py = values.to_pylist()
                bad = next(i for i, v in enumerate(py) if v is not None and not _is_int(v))
                bad_what = (bad, f"the string {py[bad]!r}")
        elif pa.types.is_floating(t):
            f = pc.fill_null(values, 0).to_numpy(zero_copy_only=False)
            frac = f != np.floor(f)
            if frac.any():
                bad_what = (int(frac.argmax()), f"{f[frac.argmax()]:g}")
            ints = pc.cast(pc.fill_null(values, 0), pa.int64(), safe=False)
        elif pa.types.is_integer(t):
            ints = values
        else:
            raise ValueError(
                f"{self.key}: column {s.column!r} is of type {t} in {file}; encoding: identity "
                "needs integer ids: use encoding: vocabulary or hashing"
            )
        if bad_what is not None:
            i, shown = bad_what
            raise ValueError(
                f"{self.key}: column {s.column!r} holds {shown} at "
                f"{where(file, row0, int(b.rows_of(np.array([i]))[0]))}; encoding: identity "
                "needs integer ids: use encoding: vocabulary or hashing for strings"
            )
        ids = pc.fill_null(ints, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        out = (ids < 0) | (ids >= s.rows)
        out &= ~nulls
        if out.any():
            i = int(out.argmax())
            raise ValueError(
                f"{self.key}: column {s.column!r} holds id {ids[i]} at "
                f"{where(file, row0, int(b.rows_of(np.array([i]))[0]))}, outside [0, rows="
                f"{s.rows}); raise sparse[{self.index}].rows or use encoding: vocabulary"
            )
        ids[nulls] = s.rows
        return ids

    def encode(self, b: Bags, split: np.ndarray, file: str, row0: int) -> np.ndarray:
        """[n, max_len] int64 ids of one batch's kept rows (split >= 0), -1 past a list's end;
        updates the statistics and the train id counts."""
        ids = self._ids(b.values, b, file, row0)
        lengths = b.lengths()
        keep = split >= 0
        self.rows += int(keep.sum())
        self.nulls += int(b.null_rows[keep].sum())
        if self.spec.kind == "single":
            out = ids.reshape(-1, 1)
        else:
            out, _ = pad(ids, b.offsets, self.max_len, keep_last=self.spec.pooling == "none")
            kl = lengths[keep]
            if kl.size:
                self.len_sum += int(kl.sum())
                self.len_max = max(self.len_max, int(kl.max()))
                lo = int(kl.min())
                self.len_min = lo if self.len_min is None else min(self.len_min, lo)
                self.truncated += int((kl > self.max_len).sum())
        out = out[keep]
        train_ids = out[split[keep] == 0]
        train_ids = train_ids[train_ids >= 0]
        if self.raw_counts is not None:
            self._count_raw(train_ids)
        else:
            self.id_counts += np.bincount(train_ids, minlength=self.num_embeddings)
        return out

    def _count_raw(self, ids: np.ndarray) -> None:
        """Merge one batch's raw train ids into the sorted (ids, counts) of a dynamic feature
        (nulls not counted): memory is the distinct train ids, never the rows."""
        ids = ids[ids != DYNAMIC_NULL]
        if not ids.size:
            return
        new, c = np.unique(ids, return_counts=True)
        old, oc = self.raw_counts
        both, inv = np.unique(np.concatenate([old, new]), return_inverse=True)
        counts = np.bincount(inv, np.concatenate([oc, c]), minlength=both.size)
        self.raw_counts = (both, counts.astype(np.int64))

    def train_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids ascending, train counts) of the ids this feature's train rows used."""
        if self.raw_counts is not None:
            return self.raw_counts
        ids = np.flatnonzero(self.id_counts).astype(np.int64)
        return ids, self.id_counts[ids]

    def distinct(self) -> int:
        """Distinct non-null values in train; hashing, and a vocabulary shared with other
        features: distinct non-null ids (the out-of-vocabulary id counts once)."""
        if self.vocabulary is not None and not self.shared_with:
            return self.vocabulary.distinct
        if self.raw_counts is not None:
            return int(self.raw_counts[0].size)
        seen = self.id_counts > 0
        seen[self.spec.rows if self.spec.encoding == "identity" else 0] = False
        return int(seen.sum())

    def describe(self) -> dict:
        """The manifest's record of this feature."""
        s = self.spec
        d = {
            "name": s.name,
            "column": s.column,
            "kind": s.kind,
            "values": self.value_type,
            "encoding": s.encoding,
            "table": self.table.name,
            "num_embeddings": self.num_embeddings,
            "width": self.table.width,
            "hotness": self.max_len if s.kind == "list" else 1,
            "jagged": s.kind == "list",
            "pooling": s.pooling,
            "rows": self.rows,
            "distinct_train": self.distinct(),
            "nulls": self.nulls,
        }
        if self.shared_with:
            d["shared_with"] = list(self.shared_with)
        if s.encoding == "dynamic":
            d["dynamic"] = dict(s.policy)
        if s.kind == "list":
            d["length"] = {
                "min": self.len_min or 0,
                "mean": self.len_sum / self.rows if self.rows else 0.0,
                "max": self.len_max,
            }
            d["max_len"] = self.max_len
            d["truncated"] = self.truncated
        return d


def make_features(spec: DatasetSpec) -> list[Feature]:
    """One Feature per sparse feature, in spec order; features of one table share its
    vocabulary and know each other's names."""
    vocabs: dict[str, Vocabulary] = {}
    out = []
    for i, s in enumerate(spec.sparse):
        vocab = None
        if s.encoding == "vocabulary":
            vocab = vocabs.setdefault(s.table, Vocabulary(s.min_count))
        shared = tuple(x.name for x in spec.sparse if x.table == s.table and x is not s)
        out.append(Feature(s, i, spec.table(s.table), vocab, shared))
    return out


def check_shared_values(features: list[Feature]) -> None:
    """After pass 1: features sharing a table hold values of one family (`_family`), else
    the same value would get different ids in them."""
    first: dict[str, Feature] = {}
    for f in features:
        if (
            not f.shared_with
            or f.spec.encoding in ("identity", "dynamic")
            or f.value_type in ("", "null")
        ):
            continue
        g = first.setdefault(f.table.name, f)
        if _family(f) != _family(g):
            raise ValueError(
                f"{f.key}: column {f.spec.column!r} holds {f.value_type} values but feature "
                f"{g.spec.name} (column {g.spec.column!r}), which shares table "
                f"{f.table.name!r}, holds {g.value_type}; one value must get one id in both: "
                "give the columns one type (cast one of them before preprocessing)"
            )


def _family(f: Feature) -> str:
    """What a value's id depends on besides the value: text or number (a vocabulary's 5 and
    5.0 are one key); hashing takes integers and booleans as int64, other numbers by repr."""
    t = f.value_type
    if t in ("string", "large_string"):
        return "text"
    if f.spec.encoding == "hashing" and not (t == "bool" or t.startswith(("int", "uint"))):
        return t
    return "number"


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def feature_line(d: dict) -> str:
    """The one line `hybridrec-preprocess` prints for a feature."""
    v = d["values"]
    values = "strings" if "string" in v else "ints" if "int" in v else f"{v} values"
    kind = f"list of {values}" if d["kind"] == "list" else values
    line = f"{d['name']}: {kind}, {d['rows']} rows, {d['distinct_train']} distinct, "
    line += f"{d['nulls']} nulls"
    if d["kind"] == "list":
        ln = d["length"]
        line += f", length {ln['min']}..{ln['max']} (mean {ln['mean']:.1f})"
        if d["truncated"]:
            line += f", {d['truncated']} truncated to {d['max_len']}"
    shared = f"shared with {', '.join(d['shared_with'])}; " if d.get("shared_with") else ""
    return line + f", table {d['table']} ({shared}{d['num_embeddings']} rows, width {d['width']})"
