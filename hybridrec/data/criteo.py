"""Raw Criteo day files -> numpy chunks, streamed by pyarrow's CSV reader.

A Criteo day file (`day_0` ... `day_23`, optionally gzip-compressed) is tab-separated with no
header and 40 fields per line: the label (0/1), 13 integer features I1..I13 (may be empty,
may be negative) and 26 categorical features C1..C26 as hex strings (8 digits in the real
data, may be empty).

pyarrow tokenises the file in blocks of `chunk_bytes` and hands over every field as raw
bytes; the numbers are decoded here with vectorised numpy over the Arrow buffers (a digit
lookup table, per-byte place values, `np.add.reduceat` per field), never a Python loop per
row. The reader is single-threaded per file on purpose: pyarrow only reports line numbers
without threads, and preprocessing gets its parallelism from running files side by side.

Bad rows are found, never guessed around: a wrong field count (pyarrow's invalid-row hook),
a label other than 0/1, a dense value that is not a (signed, at most 18-digit) integer, a
categorical value that is not 1-16 hex digits. With `on_error="error"` the first one raises
MalformedRowError naming `file:line`; with `on_error="skip"` the row is dropped and counted
(`TsvReader.skipped`, with the first few messages kept for the report).

Legend: n = rows in a chunk; 13 dense and 26 categorical columns (NUM_DENSE, NUM_CAT).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

NUM_DENSE = 13
NUM_CAT = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_CAT
FIELD_NAMES = ["label"] + [f"I{i}" for i in range(1, NUM_DENSE + 1)]
FIELD_NAMES += [f"C{i}" for i in range(1, NUM_CAT + 1)]
MAX_EXAMPLES = 5  # skipped-row messages kept for the report
SNIFF_BYTES = 1 << 16  # the start of a file that must read as text

_DEC = np.full(256, 255, np.uint8)
_DEC[48:58] = np.arange(10)
_HEX = _DEC.copy()
_HEX[97:103] = np.arange(10, 16)  # a-f
_HEX[65:71] = np.arange(10, 16)  # A-F
_POW = {
    10: (np.uint64(10) ** np.arange(19, dtype=np.uint64), 18),  # 10^18 < 2^63: no overflow
    16: (np.uint64(16) ** np.arange(16, dtype=np.uint64), 16),
}


class MalformedRowError(ValueError):
    """A raw input row that cannot be parsed; the message names the file and line (or just
    the file, when it cannot be read at all: empty, or a truncated or corrupt gzip stream)."""


def _unreadable(path: Path, e: Exception, rows: int, gz: bool) -> MalformedRowError:
    """pyarrow's errors about the file itself (not a row), naming the file (one line)."""
    if "Empty CSV file" in str(e):
        return MalformedRowError(f"{path}: the file is empty (no rows)")
    why = " ".join(str(e).split())[:200]
    hint = " (a truncated or corrupt gzip file?)" if gz else ""
    return MalformedRowError(f"{path}: cannot be read after {rows} row(s): {why}{hint}")


def _check_text(path: Path, gz: bool) -> None:
    """Raise MalformedRowError unless the file's first SNIFF_BYTES (decompressed) are text:
    no NUL byte and valid UTF-8 (a character cut at the end is fine). pyarrow would read a
    binary file as rows of garbage and leak a UnicodeDecodeError from its row handler."""
    with pa.OSFile(str(path), "r") as raw:
        stream = pa.CompressedInputStream(raw, "gzip") if gz else raw
        try:
            head = stream.read(SNIFF_BYTES)
        except OSError as e:
            raise _unreadable(path, e, 0, gz) from None
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        text = b"\0" not in head
    except UnicodeDecodeError:
        text = False
    if not text:
        what = "a gzip file whose content is not text" if gz else "not a gzip file nor text"
        raise MalformedRowError(
            f"{path}: is {what} (it starts with {head[:8]!r}); give raw Criteo TSV day files, "
            "plain or gzip-compressed"
        )


@dataclass
class RawChunk:
    """Parsed rows of one block of a day file, in file order.

    labels  [n]     uint8 in {0, 1}
    dense   [n, 13] int64, raw integers; empty fields are 0
    cat     [n, 26] uint64, raw hex values; empty fields are 0 (see `missing`)
    missing [n, 26] bool, True where the categorical field was empty
    """

    labels: np.ndarray
    dense: np.ndarray
    cat: np.ndarray
    missing: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def parse_ints(arr: pa.Array, base: int, signed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode a binary/string Arrow column of integers without a Python loop per value.

    Returns (values [n] int64 if signed else uint64, empty [n] bool, bad [n] bool). Empty
    fields decode to 0; `bad` marks fields that are not 1..18 decimal (optionally with a
    leading '-') or 1..16 hex digits.
    """
    n = len(arr)
    lut = _DEC if base == 10 else _HEX
    powers, max_digits = _POW[base]
    offsets = np.frombuffer(arr.buffers()[1], np.int32, n + 1, arr.offset * 4).astype(np.int64)
    data_buf = arr.buffers()[2]
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.empty(0, np.uint8)
    lens = np.diff(offsets)
    empty = lens == 0
    values = np.zeros(n, np.uint64)
    bad = np.zeros(n, bool)
    rows = np.flatnonzero(~empty)
    if rows.size == 0:
        return (values.astype(np.int64) if signed else values), empty, bad
    raw = data[offsets[0] : offsets[-1]]
    starts = offsets[rows] - offsets[0]
    length = lens[rows]
    k = int(length[0])
    if not signed and k <= max_digits and (length == k).all():
        # Fast path (Criteo's categoricals: always 8 hex digits): a [rows, k] digit matrix.
        digits = lut[raw].reshape(rows.size, k)
        bad[rows] = (digits == 255).any(1)
        acc = digits[:, 0].astype(np.uint64)
        for j in range(1, k):
            acc *= np.uint64(base)
            acc += digits[:, j]
        values[rows] = acc
        return values, empty, bad
    digit = lut[raw]  # [bytes] uint8; 255 = not a digit
    negative = np.zeros(rows.size, bool)
    if signed:
        negative = raw[starts] == ord("-")
        digit[starts[negative]] = 0  # the sign's place contributes nothing
    num_digits = length - negative
    not_digit = (digit == 255).view(np.uint8)
    row_bad = np.maximum.reduceat(not_digit, starts).astype(bool)
    row_bad |= (num_digits > max_digits) | (num_digits == 0)
    digit[not_digit.view(bool)] = 0
    place = np.repeat(starts + length, length) - 1 - np.arange(raw.size)  # digits to the right
    np.minimum(place, powers.size - 1, out=place)  # over-long fields are already bad
    sub = np.add.reduceat(digit.astype(np.uint64) * powers[place], starts)
    values[rows] = sub
    bad[rows] = row_bad
    if not signed:
        return values, empty, bad
    out = values.astype(np.int64)
    out[rows[negative]] *= -1
    return out, empty, bad


def _open_stream(path: Path) -> tuple[pa.NativeFile, pa.NativeFile]:
    """(raw file, decoded stream); gzip is recognised by its magic bytes, not the name. A file
    that is not text (binary, or a gzip of binary) raises MalformedRowError naming it."""
    with pa.OSFile(str(path), "r") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
    _check_text(path, gz)
    raw = pa.OSFile(str(path), "r")
    return raw, pa.CompressedInputStream(raw, "gzip") if gz else raw


class TsvReader:
    """Iterate a raw Criteo TSV (plain or gzip) as RawChunks of about `chunk_bytes` of text.

    Counters, valid after (and during) iteration: `rows` (good rows yielded), `skipped` (bad
    rows dropped with on_error='skip'), `examples` (the first skipped rows' messages),
    `bytes_read` (bytes of the file on disk consumed so far, compressed for gzip).
    """

    def __init__(self, path: str | Path, chunk_bytes: int = 4 << 20, on_error: str = "error"):
        if on_error not in ("error", "skip"):
            raise ValueError(f"on_error={on_error!r} is not one of: error, skip")
        self.path = Path(path)
        self.chunk_bytes = chunk_bytes
        self.on_error = on_error
        self.rows = 0
        self.skipped = 0
        self.examples: list[str] = []
        self.bytes_read = 0
        self._field_errors: list[tuple[int, int, str]] = []  # (line, fields, text) from pyarrow
        self._dropped_lines = np.empty(0, np.int64)  # every line pyarrow dropped so far, sorted
        self._parsed = 0  # rows pyarrow produced so far (good or bad values)

    def _on_invalid_row(self, row: pacsv.InvalidRow) -> str:
        # Called by pyarrow for rows with the wrong number of fields; single-threaded reading
        # makes row.number the physical line number.
        self._field_errors.append((row.number or 0, row.actual_columns, row.text))
        return "skip"

    def _line_of(self, row_index: np.ndarray, skipped_lines: np.ndarray) -> np.ndarray:
        """Physical line numbers (1-based) of parsed rows, given lines pyarrow dropped."""
        good = row_index + 1
        shift = skipped_lines - np.arange(skipped_lines.size)
        return good + np.searchsorted(shift, good, side="right")

    def _problem(self, line: int, message: str) -> None:
        text = f"{self.path}:{line}: {message}"
        if self.on_error == "error":
            raise MalformedRowError(text)
        self.skipped += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(text)

    def __iter__(self) -> Iterator[RawChunk]:
        raw, stream = _open_stream(self.path)
        self._gz = raw is not stream
        names = [f"f{i}" for i in range(NUM_FIELDS)]
        try:
            reader = pacsv.open_csv(
                stream,
                read_options=pacsv.ReadOptions(
                    column_names=names, use_threads=False, block_size=self.chunk_bytes
                ),
                parse_options=pacsv.ParseOptions(
                    delimiter="\t",
                    quote_char=False,
                    escape_char=False,
                    newlines_in_values=False,
                    ignore_empty_lines=False,
                    invalid_row_handler=self._on_invalid_row,
                ),
                convert_options=pacsv.ConvertOptions(
                    column_types={c: pa.binary() for c in names},
                    strings_can_be_null=False,
                    quoted_strings_can_be_null=False,
                ),
            )
        except (pa.ArrowException, OSError) as e:
            raw.close()
            raise _unreadable(self.path, e, 0, self._gz) from None
        try:
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                except (pa.ArrowException, OSError) as e:
                    raise _unreadable(self.path, e, self.rows, self._gz) from None
                chunk = self._decode(batch)
                self.bytes_read = raw.tell()
                if len(chunk):
                    self.rows += len(chunk)
                    yield chunk
            self._decode(None)  # field-count errors after the last batch
            self.bytes_read = raw.tell()
        finally:
            reader.close()
            raw.close()

    def _decode(self, batch: pa.RecordBatch | None) -> RawChunk:
        n = 0 if batch is None else batch.num_rows
        new = np.array(sorted(line for line, _, _ in self._field_errors), np.int64)
        self._dropped_lines = np.concatenate([self._dropped_lines, new])
        problems: list[tuple[int, str]] = [
            (line, f"expected {NUM_FIELDS} tab-separated fields, got {fields}: {text[:120]!r}")
            for line, fields, text in self._field_errors
        ]
        self._field_errors.clear()
        if batch is None:
            for line, message in sorted(problems):
                self._problem(line, message)
            return _empty_chunk()
        cols = batch.columns
        labels, label_empty, label_bad = parse_ints(cols[0], 10, signed=False)
        label_bad |= label_empty | (labels > 1)
        parsed = [parse_ints(cols[1 + j], 10, signed=True) for j in range(NUM_DENSE)]
        dense = np.stack([p[0] for p in parsed], axis=1)  # [n, 13]
        dense_bad = np.stack([p[2] for p in parsed], axis=1)
        parsed = [parse_ints(cols[1 + NUM_DENSE + j], 16, signed=False) for j in range(NUM_CAT)]
        cat = np.stack([p[0] for p in parsed], axis=1)  # [n, 26]
        missing = np.stack([p[1] for p in parsed], axis=1)
        cat_bad = np.stack([p[2] for p in parsed], axis=1)
        bad_rows = np.flatnonzero(label_bad | dense_bad.any(1) | cat_bad.any(1))
        if bad_rows.size:
            lines = self._line_of(self._parsed + bad_rows, self._dropped_lines)
            for row, line in zip(bad_rows.tolist(), lines.tolist(), strict=True):
                problems.append((line, self._describe(batch, row, label_bad, dense_bad, cat_bad)))
        self._parsed += n
        for line, message in sorted(problems):
            self._problem(line, message)
        if bad_rows.size:
            keep = np.ones(n, bool)
            keep[bad_rows] = False
            labels, dense, cat, missing = labels[keep], dense[keep], cat[keep], missing[keep]
        return RawChunk(labels.astype(np.uint8), dense, cat, missing)

    @staticmethod
    def _describe(
        batch: pa.RecordBatch,
        row: int,
        label_bad: np.ndarray,
        dense_bad: np.ndarray,
        cat_bad: np.ndarray,
    ) -> str:
        def value(col: int) -> str:
            return batch.column(col)[row].as_py().decode("utf-8", "replace")

        if label_bad[row]:
            return f"field 1 (label) must be 0 or 1, got {value(0)!r}"
        j = np.flatnonzero(dense_bad[row])
        if j.size:
            col = 1 + int(j[0])
            return (
                f"field {col + 1} ({FIELD_NAMES[col]}) {value(col)!r} is not an integer "
                "(at most 18 digits, optional leading '-')"
            )
        col = 1 + NUM_DENSE + int(np.flatnonzero(cat_bad[row])[0])
        return f"field {col + 1} ({FIELD_NAMES[col]}) {value(col)!r} is not 1-16 hex digits"


def _empty_chunk() -> RawChunk:
    return RawChunk(
        np.empty(0, np.uint8),
        np.empty((0, NUM_DENSE), np.int64),
        np.empty((0, NUM_CAT), np.uint64),
        np.empty((0, NUM_CAT), bool),
    )


def dense_transform(dense: np.ndarray) -> np.ndarray:
    """log(1 + max(x, 0)) in float64, stored as float32 ([n, 13] int64 -> [n, 13] float32)."""
    return np.log1p(np.maximum(dense, 0).astype(np.float64)).astype(np.float32)


def count_lines(path: str | Path, chunk: int = 8 << 20) -> int:
    """Lines in a (possibly gzip) text file; a last line without a newline counts."""
    raw, stream = _open_stream(Path(path))
    lines, last = 0, b"\n"
    try:
        while True:
            try:
                buf = stream.read(chunk)
            except OSError as e:
                raise _unreadable(Path(path), e, lines, raw is not stream) from None
            if not buf:
                break
            lines += buf.count(b"\n")
            last = buf[-1:]
    finally:
        raw.close()
    return lines + (last != b"\n")
