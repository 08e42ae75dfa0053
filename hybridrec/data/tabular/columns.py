"""Column conversions: Arrow columns of one batch -> labels, dense values, bags of raw values.

Every function takes the batch's `file` and first row `row0` so that a bad value is reported
as one line naming the column, the file and the row (1-based within the file, header not
counted). Rules (docs/data-spec.md):

- numbers: integer, float, boolean and decimal columns as is; strings (CSV) parsed as
  numbers; anything else (a list, a struct, text that is not a number) is an error.
- labels: binary = 0/1 (or true/false), or a rule on the column; regression = any finite
  number. A null label is an error, and so is a NaN (or, for regression, an infinity, or a
  finite value whose stored float32 would not be finite).
- dense: null (and NaN, which counts as one) -> 0, then the transform (log1p clips
  negatives to 0, as for Criteo); an infinity, or a value whose stored float32 would not be
  finite, is an error naming the rows. No stored value is ever NaN or inf.
- bags: `Bags(values, offsets)`, the non-null values of a feature flattened in row order
  (a single feature: one value per row, nulls included; a float NaN is a null). List
  columns (Arrow lists) or strings split at the delimiter (empty parts dropped); a null list
  is an empty bag. A list column declared `kind: single`, or a numeric column declared
  `kind: list`, is an error.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hybridrec.data.spec import DenseSpec, LabelSpec, SparseSpec

_OPS = {
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}


def is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def plain(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One contiguous array, dictionary-decoded (pandas categoricals arrive as dictionaries)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    return col


def where(file: str, row0: int, i: int) -> str:
    return f"{file} row {row0 + i + 1}"


def to_float(col: pa.Array, what: str, file: str, row0: int) -> tuple[np.ndarray, np.ndarray]:
    """(values [n] float64 with nulls as 0, null mask [n]); non-numeric data is an error."""
    t = col.type
    if is_text(t):
        try:
            col = pc.cast(col, pa.float64())
        except pa.ArrowInvalid:
            bad = next(i for i, v in enumerate(col.to_pylist()) if v is not None and not _number(v))
            raise ValueError(
                f"{what} holds {col[bad].as_py()!r} at {where(file, row0, bad)}, not a number"
            ) from None
    elif not (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or pa.types.is_decimal(t)
    ):
        raise ValueError(
            f"{what} is of type {t} in {file}, not numeric: it takes integers, floats, booleans "
            "or decimals (CSV: numbers as text)"
        )
    nulls = col.is_null().to_numpy(zero_copy_only=False)
    values = pc.fill_null(pc.cast(col, pa.float64()), 0.0).to_numpy(zero_copy_only=False)
    return values, nulls


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def labels(col: pa.Array, spec: LabelSpec, file: str, row0: int) -> np.ndarray:
    """[n] float32 labels (see the module docstring)."""
    what = f"label column {spec.column!r}"
    rule = spec.rule
    if rule is not None and isinstance(rule["value"], str):
        if col.null_count:
            bad = col.is_null().to_numpy(zero_copy_only=False).argmax()
            raise ValueError(f"{what} is empty at {where(file, row0, int(bad))}")
        text = pc.cast(col, pa.string()).to_numpy(zero_copy_only=False)
        return _OPS[rule["op"]](text, rule["value"]).astype(np.float32)
    values, nulls = to_float(col, what, file, row0)
    if nulls.any():
        raise ValueError(
            f"{what} is empty at {where(file, row0, int(nulls.argmax()))}; every row needs a label"
        )
    # NaN compares false and would become label 0 under a rule; inf is no regression target
    bad = np.isnan(values) if rule is not None else ~np.isfinite(values)
    if spec.task == "regression" and bad.any():
        rows = np.flatnonzero(bad)
        raise ValueError(
            f"{what} holds {_value(values[rows[0]])} at {_rows(file, row0, rows)}; a regression "
            "label is a finite number: fix or drop such rows"
        )
    if rule is not None:
        if bad.any():
            rows = np.flatnonzero(bad)
            raise ValueError(
                f"{what} holds NaN at {_rows(file, row0, rows)}, which the rule cannot compare; "
                "every row needs a label: fix or drop such rows"
            )
        return _OPS[rule["op"]](values, float(rule["value"])).astype(np.float32)
    if spec.task == "binary":
        bad = (values != 0) & (values != 1)
        if bad.any():
            i = int(bad.argmax())
            raise ValueError(
                f"{what} holds {_value(values[i])} at {where(file, row0, i)}; a binary label is 0 "
                "or 1: give a rule (label.rule: {op: '>=', value: 4}) or task: regression"
            )
    with np.errstate(over="ignore"):  # beyond float32: inf, refused below as a dense value is
        stored = values.astype(np.float32)
    over = ~np.isfinite(stored)
    if over.any():
        rows = np.flatnonzero(over)
        raise ValueError(
            f"{what} holds {values[rows[0]]:g} at {_rows(file, row0, rows)}, which is not finite "
            "in float32 (labels are stored as float32, |x| <= 3.4e38); rescale the label or fix "
            "or drop such rows"
        )
    return stored


def _value(x: float) -> str:
    return "NaN" if np.isnan(x) else f"{x:g}"


def _rows(file: str, row0: int, rows: np.ndarray, first: int = 3) -> str:
    """ "f.csv row 5" or "f.csv rows 5, 9, 12 (and 4 more in this batch)"."""
    shown = ", ".join(str(row0 + int(i) + 1) for i in rows[:first])
    more = f" (and {len(rows) - first} more in this batch)" if len(rows) > first else ""
    return f"{file} row{'s' if len(rows) > 1 else ''} {shown}{more}"


def dense(
    col: pa.Array, spec: DenseSpec, file: str, row0: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(raw values [n] float64 with nulls as 0, null mask [n], NaN mask [n]): a NaN is a
    null too (pandas' missing value: it is in the null mask, its value 0); an infinity is
    refused naming the rows. Transforms come later (they need the train statistics)."""
    what = f"dense column {spec.column!r}"
    values, nulls = to_float(col, what, file, row0)
    inf = np.isinf(values)
    if inf.any():
        rows = np.flatnonzero(inf)
        raise ValueError(
            f"{what} holds {_value(values[rows[0]])} at {_rows(file, row0, rows)}; a dense value "
            "is a finite number: replace it (a cap, or an empty cell for a missing value, which "
            "counts as a null)"
        )
    nan = np.isnan(values)
    return np.where(nan, 0.0, values), nulls | nan, nan


def transform(values: np.ndarray, kind: str, mean: float = 0.0, std: float = 1.0) -> np.ndarray:
    """The stored float32 value of raw (null-filled) `values`."""
    if kind == "log1p":
        return np.log1p(np.maximum(values, 0.0)).astype(np.float32)
    with np.errstate(over="ignore"):  # beyond float32: inf, refused by check_finite
        if kind == "standardize":
            return ((values - mean) / (std if std > 0 else 1.0)).astype(np.float32)
        return values.astype(np.float32)


def check_finite(
    stored: np.ndarray, raw: np.ndarray, spec: DenseSpec, file: str, row0: int
) -> None:
    """Every stored value is finite: a finite raw value beyond float32 (|x| > 3.4e38 with
    transform none) is refused naming the row, never stored as inf."""
    bad = ~np.isfinite(stored)
    if bad.any():
        rows = np.flatnonzero(bad)
        raise ValueError(
            f"dense column {spec.column!r} holds {raw[rows[0]]:g} at {_rows(file, row0, rows)}, "
            f"which is not finite in float32 after transform {spec.transform}; rescale the "
            "column or use transform: log1p or standardize"
        )


@dataclass
class Bags:
    """A feature's values in one batch: `values` [m] (Arrow, nulls allowed for single features
    only), row r's values are values[offsets[r]:offsets[r + 1]]; `null_rows` [n] marks the
    null rows (a null value, or a null list)."""

    values: pa.Array
    offsets: np.ndarray  # [n + 1] int64
    null_rows: np.ndarray  # [n] bool

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def rows_of(self, idx: np.ndarray) -> np.ndarray:
        """The row of each value index in `idx`."""
        return np.searchsorted(self.offsets, idx, side="right") - 1


def bags(col: pa.Array, spec: SparseSpec, i: int, file: str, row0: int) -> Bags:
    """The feature's values, checked against its declared kind (see the module docstring)."""
    key = f"sparse[{i}] ({spec.name}): column {spec.column!r}"
    t, n = col.type, len(col)
    if spec.kind == "single":
        if is_list(t):
            raise ValueError(
                f"{key} holds lists ({t}) in {file} but the spec declares kind: single; use "
                "kind: list"
            )
        col = _nan_to_null(col)
        return Bags(col, np.arange(n + 1, dtype=np.int64), _nulls(col))
    if is_text(t):
        col = pc.split_pattern(col, spec.delimiter)
    elif not is_list(t):
        raise ValueError(
            f"{key} holds scalars ({t}) in {file} but the spec declares kind: list; use kind: "
            "single, or store lists (or delimited strings)"
        )
    null_rows = _nulls(col)
    lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(col)
    if pa.types.is_dictionary(flat.type):
        flat = flat.dictionary_decode()
    if is_text(flat.type):  # "a||b", "a|": empty parts are not values
        keep = pc.fill_null(pc.not_equal(flat, ""), True)
        if not pc.all(keep).as_py():
            starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            kept = keep.to_numpy(zero_copy_only=False)
            rows = np.searchsorted(starts, np.flatnonzero(kept), side="right") - 1
            lengths = np.bincount(rows, minlength=n)
            flat = flat.filter(keep)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Bags(_nan_to_null(flat), offsets, null_rows)


def _nulls(col: pa.Array) -> np.ndarray:
    return col.is_null().to_numpy(zero_copy_only=False)


def _nan_to_null(values: pa.Array) -> pa.Array:
    """A float NaN category is a null (a missing value, as in a dense column): it gets the
    null id. As a value it could not even be looked up (NaN != NaN)."""
    if not pa.types.is_floating(values.type):
        return values
    nan = pc.is_nan(values)
    if not pc.any(nan).as_py():
        return values
    return pc.if_else(nan, pa.scalar(None, values.type), values)


def pad(
    ids: np.ndarray, offsets: np.ndarray, max_len: int, keep_last: bool = False
) -> tuple[np.ndarray, int]:
    """Bags of ids -> ([n, max_len] int64 padded with -1 after the real ids, rows truncated):
    a bag longer than max_len keeps its first max_len ids, or with `keep_last` (a sequence:
    its most recent events) its last ones, still in order from the first column."""
    n = len(offsets) - 1
    lengths = np.diff(offsets)
    out = np.full((n, max_len), -1, np.int64)
    rows = np.repeat(np.arange(n), lengths)
    pos = np.arange(len(ids)) - np.repeat(offsets[:-1], lengths)
    if keep_last:  # drop the first (length - max_len) of a long one
        pos = pos - np.repeat(np.maximum(lengths - max_len, 0), lengths)
        keep = pos >= 0
    else:
        keep = pos < max_len
    out[rows[keep], pos[keep]] = ids[keep]
    return out, int((lengths > max_len).sum())
