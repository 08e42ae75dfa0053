"""The dataset spec: which columns of a user's table become the label, dense and sparse features.

A YAML file (docs/data-spec.md) parsed into frozen dataclasses; `load_spec(path)` raises a
ValueError of one line naming the file and the key (`sparse[1] (genres).encoding`) for any
mistake. Defaults are filled in, so `DatasetSpec.to_dict()` is the complete, normalised spec
that the manifest records, and `fingerprint()` (a hash of it) identifies it.

An optional `input` section says how CSV/TSV files are read: a header row (the default) or
headerless fields named by `input.columns` (Criteo's day files), the delimiter, and the
format when the file names do not tell it (`day_0`).

Invariants checked here: every feature's table listed under `tables` and every listed table
used, distinct feature names, a binary label rule only for binary tasks, disjoint split
values, fractions in range, a dynamic table's rows (if given) equal to its capacity. Several
features may share one table (a user id and a list of followed user ids: the same value must
hit the same row), so they encode alike: all
`vocabulary` with one `min_count` (one vocabulary over their train values), all `hashing`
with one `cap`, all `identity` with one `rows`, or all `dynamic` with one `capacity` and
policy. `dynamic` (docs/dynamic.md) keeps raw ids: integers as they are, strings hashed
(hybridrec.data.tabular.encode), mapped to slots while training. Whether the columns exist
and hold the declared kinds is checked against the data (hybridrec.data.tabular).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hybridrec.dynamic_policy import POLICY_KEYS, PolicyError, policy_of

TASKS = ("binary", "regression")
TRANSFORMS = ("none", "log1p", "standardize")
KINDS = ("single", "list")
ENCODINGS = ("vocabulary", "hashing", "identity", "dynamic")
# encoding: dynamic's optional `policy` keys: Dynamic's (hybridrec.dynamic_policy, torch-free as
# preprocessing needs) but min_count, the feature's own key; keys left out take Dynamic's
# defaults when the trainer builds the table
SPEC_POLICY_KEYS = tuple(k for k in POLICY_KEYS if k != "min_count")
POOLINGS = ("sum", "mean", "none")  # none: a list read as a sequence, a row per id, in order
RULE_OPS = ("==", "!=", ">", ">=", "<", "<=")
SPLITS_BY = ("column", "rows", "fraction")
INPUT_FORMATS = ("csv", "tsv")
MAX_LIST_LEN = 256  # the default max_len (the longest train list) is capped at this


@dataclass(frozen=True)
class LabelSpec:
    column: str
    task: str = "binary"
    rule: dict[str, Any] | None = None  # binary only: {op, value}; label = column <op> value


@dataclass(frozen=True)
class DenseSpec:
    column: str
    transform: str = "none"


@dataclass(frozen=True)
class SparseSpec:
    name: str
    column: str
    kind: str = "single"
    encoding: str = "vocabulary"
    min_count: int = 1  # vocabulary: train values seen fewer times share the OOV id
    cap: int | None = None  # hashing: the table's rows (id 0 = null, 1..cap-1 hashed values)
    rows: int | None = None  # identity: ids are in [0, rows); the null id is `rows`
    # dynamic: raw int64 ids (no vocabulary), mapped to `capacity` slots while training by the
    # `policy` (admit, evict, ...; min_count is admit: count's threshold)
    capacity: int | None = None
    policy: dict[str, Any] | None = None
    table: str = ""  # default: the feature's name
    pooling: str = "sum"  # list: sum, mean, or none (a sequence: its ids' rows in order)
    # list: longer lists are truncated (a sequence keeps its last, most recent ids; a bag its
    # first); None = the longest in train
    max_len: int | None = None
    delimiter: str = "|"  # list columns read from CSV: the separator inside the string


@dataclass(frozen=True)
class TableSpec:
    name: str
    width: int
    rows: int | None = None  # None: what the feature's encoding needs


@dataclass(frozen=True)
class SplitSpec:
    by: str = "fraction"
    column: str | None = None  # by=column
    values: dict[str, list[Any]] | None = None  # by=column: split -> the column's values
    train_fraction: float = 0.8  # by=rows: the first fraction of rows (file order) is train
    val: float = 0.1  # by=fraction: per-row probability of val ...
    test: float = 0.1  # ... and of test
    seed: int = 0  # by=fraction: seeds the per-row uniform draws (in file order)


@dataclass(frozen=True)
class InputSpec:
    """How CSV/TSV inputs are read; a spec without `input` reads a header row and takes the
    format from the file names."""

    format: str | None = None  # csv | tsv for every input, whatever its name (None: by name)
    header: bool = True  # False: no header row; `columns` names the fields in file order
    columns: tuple[str, ...] | None = None  # header: false only, one name per field
    delimiter: str | None = None  # one character (None: ',' for csv, tab for tsv)


@dataclass(frozen=True)
class DatasetSpec:
    label: LabelSpec
    dense: tuple[DenseSpec, ...]
    sparse: tuple[SparseSpec, ...]
    tables: tuple[TableSpec, ...]
    split: SplitSpec
    input: InputSpec | None = None

    def table(self, name: str) -> TableSpec:
        return next(t for t in self.tables if t.name == name)

    def columns(self) -> list[str]:
        """Every column the spec reads, in first-use order."""
        cols = [self.label.column, *(d.column for d in self.dense)]
        cols += [s.column for s in self.sparse]
        if self.split.by == "column" and self.split.column:
            cols.append(self.split.column)
        return list(dict.fromkeys(cols))

    def to_dict(self) -> dict[str, Any]:
        """Every key with its default filled in; `input` only when the spec has one (absent, the
        reading defaults apply and are not part of the spec's identity), and a sparse
        feature's `capacity` and `policy` only when dynamic: a spec written before those keys
        existed keeps its fingerprint (what data.spec and reruns compare)."""
        d = dataclasses.asdict(self)
        if self.input is None:
            del d["input"]
        for feature in d["sparse"]:
            if feature["encoding"] != "dynamic":
                del feature["capacity"], feature["policy"]
        return d

    def fingerprint(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class _Reader:
    """Checks one mapping of the YAML: known keys only, typed values, messages naming the key."""

    def __init__(self, where: str, key: str, value: Any, allowed: tuple[str, ...]) -> None:
        self.where, self.key = where, key
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {key} must be a mapping with keys {', '.join(allowed)}")
        unknown = [k for k in value if k not in allowed]
        if unknown:
            raise ValueError(
                f"{where}: {key}.{unknown[0]} is not a key of {key}; keys: {', '.join(allowed)}"
            )
        self.d = value

    def fail(self, sub: str, what: str) -> ValueError:
        sep = "" if what.startswith("=") else " "
        return ValueError(f"{self.where}: {self.key}.{sub}{sep}{what}")

    def get(self, sub: str, kind: type | tuple, default: Any = ..., choices: tuple = ()) -> Any:
        if sub not in self.d or self.d[sub] is None:
            if default is ...:
                raise self.fail(sub, "is required")
            return default
        v = self.d[sub]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise self.fail(sub, f"must be {names}, got {v!r}")
        if choices and v not in choices:
            raise self.fail(sub, f"={v!r} is not one of: {', '.join(choices)}")
        if kind is int and v < 1:
            raise self.fail(sub, f"must be >= 1, got {v}")
        return v


def _label(where: str, d: Any) -> LabelSpec:
    r = _Reader(where, "label", d, ("column", "task", "rule"))
    task = r.get("task", str, "binary", TASKS)
    rule = r.d.get("rule")
    if rule is not None:
        if task != "binary":
            raise r.fail("rule", "makes a binary label; it does not apply to task: regression")
        rr = _Reader(where, "label.rule", rule, ("op", "value"))
        op = rr.get("op", str, choices=RULE_OPS)
        value = rr.get("value", (int, float, str))
        if isinstance(value, str) and op not in ("==", "!="):
            raise rr.fail("value", f"must be a number for op {op!r}, got {value!r}")
        rule = {"op": op, "value": value}
    return LabelSpec(r.get("column", str), task, rule)


def _list(where: str, key: str, value: Any) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{where}: {key} must be a list, got {type(value).__name__}")
    return value


def _sparse(where: str, i: int, d: Any) -> SparseSpec:
    fields = tuple(f.name for f in dataclasses.fields(SparseSpec))
    r = _Reader(where, f"sparse[{i}]", d, fields)
    column = r.get("column", str)
    name = r.get("name", str, column)
    r.key = f"sparse[{i}] ({name})"
    encoding = r.get("encoding", str, "vocabulary", ENCODINGS)
    kind = r.get("kind", str, "single", KINDS)
    s = SparseSpec(
        name=name,
        column=column,
        kind=kind,
        encoding=encoding,
        min_count=r.get("min_count", int, 1),
        cap=r.get("cap", int, None),
        rows=r.get("rows", int, None),
        capacity=r.get("capacity", int, None),
        policy=_policy(r, d, encoding),
        table=r.get("table", str, name),
        pooling=r.get("pooling", str, "sum", POOLINGS),
        max_len=r.get("max_len", int, None),
        delimiter=r.get("delimiter", str, "|"),
    )
    if s.pooling == "none" and kind != "list":
        raise r.fail("pooling", "none (a sequence) needs kind: list (a single id is pooled)")
    needs = {"hashing": "cap", "identity": "rows", "dynamic": "capacity"}.get(encoding)
    if needs and getattr(s, needs) is None:
        raise r.fail(needs, f"is required with encoding: {encoding}")
    if encoding == "hashing" and s.cap < 2:
        raise r.fail("cap", f"must be >= 2 (id 0 is the null id), got {s.cap}")
    dynamic = policy_of(s.policy) if s.policy is not None else None
    if dynamic is not None and not dynamic.fits(s.capacity):
        need = dynamic.reserved_rows + 1
        raise r.fail(
            "capacity",
            f"={s.capacity} must be a multiple of policy.buckets={dynamic.buckets} with >= "
            f"{need} slots per bucket (every hash bucket holds capacity / buckets slots"
            f"{', one of them its unknown row' if dynamic.reserved_rows else ''})",
        )
    for key, owners in (
        ("cap", ("hashing",)),
        ("rows", ("identity",)),
        ("min_count", ("vocabulary", "dynamic")),
        ("capacity", ("dynamic",)),
        ("policy", ("dynamic",)),
    ):
        if key in d and encoding not in owners:
            raise r.fail(key, f"applies to encoding: {' or '.join(owners)}, not {encoding}")
    for key in ("max_len", "delimiter"):
        if key in d and kind != "list":
            raise r.fail(key, "applies to kind: list only")
    if not s.delimiter:
        raise r.fail("delimiter", "must not be empty")
    return s


def _policy(r: _Reader, d: dict, encoding: str) -> dict[str, Any] | None:
    """encoding: dynamic's policy: the keys given (with min_count, always), checked by
    Dynamic itself (hybridrec.dynamic_policy), whose error names the key; the trainer fills
    the rest with Dynamic's defaults."""
    if encoding != "dynamic":
        return None
    pr = _Reader(r.where, f"{r.key}.policy", d.get("policy") or {}, SPEC_POLICY_KEYS)
    policy: dict[str, Any] = {"min_count": r.get("min_count", int, 1)}
    policy.update({k: pr.d[k] for k in SPEC_POLICY_KEYS if pr.d.get(k) is not None})
    if policy.get("evict") == "ttl" and "ttl_steps" not in policy:
        raise pr.fail("ttl_steps", "is required with evict: ttl (steps an unused id keeps its row)")
    try:
        checked = policy_of(policy)
    except PolicyError as e:
        raise (r if e.key == "min_count" else pr).fail(e.key, e.problem) from None
    if "probability" in policy:
        policy["probability"] = checked.probability  # a float, as Dynamic keeps it
    return policy


def _split(where: str, d: Any) -> SplitSpec:
    if d is None:
        return SplitSpec()
    fields = tuple(f.name for f in dataclasses.fields(SplitSpec))
    r = _Reader(where, "split", d, fields)
    by = r.get("by", str, choices=SPLITS_BY)
    own = {"column": ("column", "values"), "rows": ("train_fraction",)}
    own["fraction"] = ("val", "test", "seed")
    for key in d:
        if key != "by" and key not in own[by]:
            raise r.fail(key, f"does not apply to split by: {by} (its keys: {', '.join(own[by])})")
    if by == "column":
        vr = _Reader(where, "split.values", r.get("values", dict), ("train", "val", "test"))
        values, seen = {}, {}
        for name in ("train", "val", "test"):
            v = vr.d.get(name)
            v = [] if v is None else v if isinstance(v, list) else [v]
            for x in v:
                if x in seen:
                    raise vr.fail(name, f"repeats {x!r}, already in split {seen[x]}")
                seen[x] = name
            values[name] = v
        if not values["train"]:
            raise vr.fail("train", "is required: the column values of the training rows")
        return SplitSpec(by, r.get("column", str), values)
    if by == "rows":
        f = float(r.get("train_fraction", (int, float), 0.8))
        if not 0.0 < f <= 1.0:
            raise r.fail("train_fraction", f"must be in (0, 1], got {f}")
        return SplitSpec(by, train_fraction=f)
    val, test = (float(r.get(k, (int, float), 0.1)) for k in ("val", "test"))
    if val < 0 or test < 0 or val + test >= 1:
        raise r.fail("val", f"and split.test must be >= 0 with val + test < 1, got {val}, {test}")
    seed = r.d.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise r.fail("seed", f"must be an integer >= 0, got {seed!r}")
    return SplitSpec(by, val=val, test=test, seed=seed)


def _input(where: str, d: Any) -> InputSpec | None:
    if d is None:
        return None
    fields = tuple(f.name for f in dataclasses.fields(InputSpec))
    r = _Reader(where, "input", d, fields)
    fmt = r.get("format", str, None, INPUT_FORMATS)
    header = r.get("header", bool, True)
    columns = r.d.get("columns")
    if columns is not None:
        if header:
            raise r.fail(
                "columns", "applies to header: false only (a header row names the columns)"
            )
        if not isinstance(columns, list) or not columns:
            raise r.fail("columns", "must be a list of column names, one per field in file order")
        for i, c in enumerate(columns):
            if not isinstance(c, str) or not c:
                raise r.fail(f"columns[{i}]", f"must be a column name (a string), got {c!r}")
            if c in columns[:i]:
                raise r.fail(f"columns[{i}]", f"repeats the name {c!r}; names differ")
        columns = tuple(columns)
    elif not header:
        raise r.fail("columns", "is required with header: false: the name of every field, in order")
    delimiter = r.get("delimiter", str, None)
    if delimiter is not None and len(delimiter) != 1:
        raise r.fail("delimiter", f"must be one character, got {delimiter!r}")
    return InputSpec(fmt, header, columns, delimiter)


def parse_spec(d: Any, where: str = "spec") -> DatasetSpec:
    """A spec mapping (as read from YAML) -> DatasetSpec; ValueError naming `where` and the key."""
    keys = ("label", "dense", "sparse", "tables", "split", "input")
    if not isinstance(d, dict):
        raise ValueError(f"{where}: the spec must be a mapping with keys {', '.join(keys)}")
    unknown = [k for k in d if k not in keys]
    if unknown:
        raise ValueError(f"{where}: {unknown[0]} is not a spec key; keys: {', '.join(keys)}")
    if "label" not in d:
        raise ValueError(f"{where}: label is required (label: {{column: ..., task: binary}})")
    label = _label(where, d["label"])
    dense = []
    for i, x in enumerate(_list(where, "dense", d.get("dense"))):
        r = _Reader(where, f"dense[{i}]", x, ("column", "transform"))
        dense.append(DenseSpec(r.get("column", str), r.get("transform", str, "none", TRANSFORMS)))
    sparse = [_sparse(where, i, x) for i, x in enumerate(_list(where, "sparse", d.get("sparse")))]
    if not sparse:
        raise ValueError(f"{where}: sparse must list at least one categorical or list column")
    tables = []
    for i, x in enumerate(_list(where, "tables", d.get("tables"))):
        r = _Reader(where, f"tables[{i}]", x, ("name", "width", "rows"))
        tables.append(TableSpec(r.get("name", str), r.get("width", int), r.get("rows", int, None)))
    _check_names(where, sparse, tables)
    split, input_ = _split(where, d.get("split")), _input(where, d.get("input"))
    return DatasetSpec(label, tuple(dense), tuple(sparse), tuple(tables), split, input_)


def _check_names(where: str, sparse: list[SparseSpec], tables: list[TableSpec]) -> None:
    names, listed, users = set(), {t.name: i for i, t in enumerate(tables)}, {}
    if len(listed) != len(tables):
        dup = next(t.name for i, t in enumerate(tables) if listed[t.name] != i)
        raise ValueError(f"{where}: tables lists {dup!r} twice")
    for i, s in enumerate(sparse):
        if s.name in names:
            raise ValueError(f"{where}: sparse[{i}].name {s.name!r} is used twice; names differ")
        names.add(s.name)
        users.setdefault(s.table, []).append(s)
        if s.table not in listed:
            raise ValueError(
                f"{where}: sparse[{i}] ({s.name}) uses table {s.table!r}, which tables does not "
                f"list; add {{name: {s.table}, width: 16}} to tables"
            )
    unused = [t.name for t in tables if t.name not in users]
    if unused:
        raise ValueError(f"{where}: tables lists {unused[0]!r}, which no sparse feature uses")
    for j, t in enumerate(tables):
        s = users[t.name][0]
        if s.encoding == "dynamic" and t.rows not in (None, s.capacity):
            raise ValueError(
                f"{where}: tables[{j}] ({t.name}).rows={t.rows} differs from sparse["
                f"{sparse.index(s)}] ({s.name}).capacity={s.capacity}; a dynamic table has "
                "capacity rows: leave rows out"
            )
    for table, shared in users.items():
        _check_shared(where, table, shared)


def encoding_key(s: SparseSpec) -> tuple[str, Any]:
    """What features sharing a table must agree on: the encoding and its parameters."""
    if s.encoding == "dynamic":
        return s.encoding, (s.capacity, tuple(sorted(s.policy.items())))  # as given
    param = {"vocabulary": s.min_count, "hashing": s.cap, "identity": s.rows}[s.encoding]
    return s.encoding, param


def _check_shared(where: str, table: str, shared: list[SparseSpec]) -> None:
    first = shared[0]
    for s in shared[1:]:
        if encoding_key(s) != encoding_key(first):
            a, b = (f"{x.name} ({x.encoding} {_param(x)})" for x in (first, s))
            raise ValueError(
                f"{where}: features {a} and {b} share table {table!r} but encode differently; "
                "give every feature of one table the same encoding: vocabulary with one "
                "min_count, hashing with one cap, identity with one rows, or dynamic with one "
                "capacity and policy"
            )


def _param(s: SparseSpec) -> str:
    if s.encoding == "dynamic":
        return f"capacity={s.capacity}, policy={s.policy}"
    key = {"vocabulary": "min_count", "hashing": "cap", "identity": "rows"}[s.encoding]
    return f"{key}={getattr(s, key)}"


def load_spec(path: str | Path) -> DatasetSpec:
    """Read and check the spec YAML at `path` (one-line ValueError naming the file and key)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"spec {p}: no such file")
    try:
        d = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML ({' '.join(str(e).split())})") from None
    return parse_spec(d, str(p))
