"""Reading the user's table: inputs -> pyarrow datasets -> record batches with their split.

Inputs are Parquet files or directories (Spark, pandas, duckdb output; hive-partitioned
`key=value/` directories add their keys as columns) or CSV/TSV files (header row first, or
none with the spec's `input.columns`) or directories of them; the format comes from the file
names (.parquet/.pq, .csv, .tsv/.tab, optionally compressed: .gz, .bz2, .zst) unless the
spec's `input.format` names it. A CSV row with the wrong number of fields is an error naming
the file and the row. CSV is parsed in blocks of 1 MiB (pyarrow's default); a line longer than
a block is read by growing the block (x4, up to 1 GiB: `CSV_BLOCKS`) and re-reading the file
from its start, skipping the rows already read, so no row is read twice; a longer line is an
error naming the file and its row. Files are read in natural order (part-2 before part-10),
one fragment at a time, in batches of `batch_rows` rows: memory is bounded by the batch (and
Parquet's row groups, or the longest CSV line), never by the number of rows. CSV columns the
spec names are read as strings (empty field = null) and converted by
hybridrec.data.tabular.columns, which can then name the row of a bad value.

Every batch comes with its file and first row (0-based within the file) and a split code
per row (0 train, 1 val, 2 test, -1 in no split: dropped), computed in file order so that
both passes, and every rerun, agree.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.dataset as ds

from hybridrec.data.preprocess.options import UsageError
from hybridrec.data.spec import DatasetSpec, SplitSpec

log = logging.getLogger(__name__)

SPLIT_CODES = {"train": 0, "val": 1, "test": 2}
# CSV block sizes in bytes, tried in order when a line does not fit in one (pyarrow's default
# first; its block size is an int32, and a line over 1 GiB is better stored otherwise)
CSV_BLOCKS = (1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28, 1 << 30)
_COMPRESSED = (".gz", ".bz2", ".zst")
_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv", ".tab": "tsv"}


def _natural(path: str) -> list:
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", path)]


def _visible(p: Path) -> bool:
    return not p.name.startswith((".", "_"))  # Spark's _SUCCESS, .crc files: not data


def file_format(path: Path) -> str:
    """parquet | csv | tsv, from the file name (a compression suffix is skipped)."""
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in _COMPRESSED:
        suffixes.pop()
    fmt = _FORMATS.get(suffixes[-1] if suffixes else "")
    if fmt is None:
        raise UsageError(
            f"input {path}: cannot tell its format from the name; name Parquet files "
            "*.parquet, CSV files *.csv, TSV files *.tsv"
        )
    return fmt


def input_format(inputs: list[Path], forced: str | None = None) -> str:
    """The one format of every input file (directories: the files under them); `forced`
    (the spec's input.format) instead of the names."""
    found: dict[str, Path] = {}
    for p in inputs:
        if p.is_dir():
            files = [
                f
                for f in sorted(p.rglob("*"))
                if f.is_file()
                and all(_visible(q) for q in f.relative_to(p).parents if q.name)
                and _visible(f)
            ]
            if not files:
                raise UsageError(f"input directory {p} holds no data files")
        elif p.is_file():
            files = [p]
        else:
            raise UsageError(f"input {p} does not exist")
        for f in files:
            found.setdefault(forced or file_format(f), f)
    if len(found) > 1:
        kinds = ", ".join(f"{k} ({v})" for k, v in found.items())
        raise UsageError(f"the inputs mix formats: {kinds}; give files of one format")
    return next(iter(found))


class BadRows:
    """pyarrow's hook for CSV rows with the wrong number of fields: keeps the first one (its
    physical line, header included) and makes the read fail, so the error can name it."""

    def __init__(self, header: bool) -> None:
        self.header, self.first = header, None

    def __call__(self, row: pacsv.InvalidRow) -> str:
        if self.first is None:
            self.first = row
        return "error"

    def message(self, file: str) -> str | None:
        r, self.first = self.first, None
        if r is None:
            return None
        at = f"{file} row {r.number - self.header}" if (r.number or 0) > 0 else file
        names = "the spec's input.columns names" if not self.header else "the header row has"
        return (
            f"{at} has {r.actual_columns} fields but {names} {r.expected_columns}: "
            f"{r.text[:80]!r}; fix or remove the row"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


def _long_line(file: str, limit: int) -> int | None:
    """The 1-based physical line number of the first line of `file` (decompressed) longer than
    `limit` bytes, or None (a quoted field with newlines spans lines: none may be that long)."""
    line, length = 1, 0
    with pa.input_stream(file, compression="detect") as f:
        while chunk := f.read(1 << 24):
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0:
                if length + end - start > limit:
                    return line
                line, length, start = line + 1, 0, end + 1
            length += len(chunk) - start
            if length > limit:
                return line
    return None


def _straddles(e: Exception) -> bool:
    """pyarrow's error for a CSV line longer than its read block."""
    return "straddl" in str(e)


@dataclass
class Table:
    """The opened inputs: one pyarrow dataset per input path, all of one format. CSV/TSV:
    `csv_format(block_size)` makes the file format, `block` indexes CSV_BLOCKS (grown, for
    every later read too, when a line does not fit)."""

    paths: list[Path]
    datasets: list[ds.Dataset]
    format: str
    bad_rows: BadRows | None = None  # CSV/TSV
    csv_format: Callable[[int], ds.FileFormat] | None = None  # CSV/TSV
    block: int = 0

    @property
    def schema(self) -> pa.Schema:
        return self.datasets[0].schema

    def fragments(self) -> Iterator[tuple[ds.Dataset, ds.Fragment]]:
        for d in self.datasets:
            for frag in sorted(d.get_fragments(), key=lambda f: _natural(f.path)):
                yield d, frag

    def _current(self, frag: ds.Fragment) -> ds.Fragment:
        """`frag` read with the current block size (the dataset's own until one grew)."""
        if self.block == 0:
            return frag
        fmt = self.csv_format(CSV_BLOCKS[self.block])
        return fmt.make_fragment(frag.path, frag.filesystem, frag.partition_expression)

    def _grow(self, e: Exception, file: str) -> None:
        """After pyarrow's straddle error reading `file`: the next block size, or a ValueError
        naming the file and the long line's row when the largest block was too small."""
        if not (self.csv_format and _straddles(e)):
            return
        if self.block + 1 == len(CSV_BLOCKS):
            limit = CSV_BLOCKS[-1]
            line = _long_line(file, limit)
            where = "a line" if line is None else f"row {line - bool(self.bad_rows.header)}"
            raise ValueError(
                f"{file}: {where} is longer than {_mib(limit)}, the largest CSV block read; "
                "shorten that field (split a long list over rows or columns) or convert the "
                "file to Parquet"
            ) from None
        self.block += 1
        log.warning(
            "%s: a line is longer than %s; reading with %s blocks",
            file,
            _mib(CSV_BLOCKS[self.block - 1]),
            _mib(CSV_BLOCKS[self.block]),
        )

    def count_rows(self) -> int:
        total = 0
        for _, frag in self.fragments():
            while True:
                try:
                    total += self._current(frag).count_rows()
                    break
                except pa.ArrowInvalid as e:
                    self._grow(e, frag.path)
                    if not (self.csv_format and _straddles(e)):
                        raise self._unreadable(e, frag.path, None) from None
        return total

    def _unreadable(self, e: Exception, file: str, row: int | None) -> ValueError:
        bad = self.bad_rows and self.bad_rows.message(file)
        if bad:
            return ValueError(bad)
        why = " ".join(str(e).split())[:300]
        return ValueError(
            f"{file}: cannot be read{'' if row is None else f' after row {row}'}: {why}"
        )

    def batches(
        self, columns: list[str], batch_rows: int
    ) -> Iterator[tuple[str, int, pa.RecordBatch]]:
        """(file, first row in the file, batch) in file order; unreadable files name themselves.
        A CSV line longer than the read block: the file is read again with larger blocks from
        its start, the `row` rows already yielded skipped."""
        for d, frag in self.fragments():
            row = 0
            while True:
                skip = row
                try:
                    source = self._current(frag)
                    for b in source.to_batches(
                        schema=d.schema, columns=columns, batch_size=batch_rows
                    ):
                        if skip:
                            b, skip = b.slice(min(skip, b.num_rows)), max(skip - b.num_rows, 0)
                            if not b.num_rows:
                                continue
                        yield frag.path, row, b
                        row += b.num_rows
                    break
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
                    self._grow(e, frag.path)
                    if not (self.csv_format and _straddles(e)):
                        raise self._unreadable(e, frag.path, row) from None


def open_table(inputs: list[str | Path], spec: DatasetSpec) -> Table:
    """Open `inputs` and check that every column the spec names is there (else one line
    naming the column, the spec key and the available columns)."""
    paths = [Path(p) for p in inputs]
    if not paths:
        raise UsageError("no input files given")
    inp = spec.input
    fmt = input_format(paths, inp.format if inp else None)
    bad_rows = None
    if fmt == "parquet":
        if inp is not None:
            raise UsageError(
                f"the spec's input section applies to CSV/TSV inputs, but {paths[0]} is "
                "Parquet; remove input from the spec"
            )
        file_format_: ds.FileFormat = ds.ParquetFileFormat()
    else:
        header = inp is None or inp.header
        bad_rows = BadRows(header)
        names = list(spec.columns() if header else inp.columns)
        delimiter = inp.delimiter if inp and inp.delimiter else "\t" if fmt == "tsv" else ","

        def csv_format(block_size: int) -> ds.FileFormat:
            return ds.CsvFileFormat(
                read_options=pacsv.ReadOptions(
                    column_names=None if header else list(inp.columns), block_size=block_size
                ),
                parse_options=pacsv.ParseOptions(delimiter=delimiter, invalid_row_handler=bad_rows),
                convert_options=pacsv.ConvertOptions(
                    column_types={c: pa.string() for c in names},
                    strings_can_be_null=True,
                    null_values=[""],  # only an empty field: "NA" is a value (as for Criteo)
                ),
            )

        file_format_ = csv_format(CSV_BLOCKS[0])
    table = Table(paths, [], fmt, bad_rows, csv_format if fmt != "parquet" else None)
    for p in paths:
        while True:  # opening reads the first block (a CSV's header and first rows)
            try:
                table.datasets.append(ds.dataset(str(p), format=file_format_, partitioning="hive"))
                break
            except (pa.ArrowInvalid, OSError) as e:
                if fmt != "parquet" and _straddles(e):
                    table._grow(e, str(p))
                    file_format_ = csv_format(CSV_BLOCKS[table.block])
                    continue
                bad = bad_rows and bad_rows.message(str(p))
                raise ValueError(
                    bad or f"input {p}: cannot be read as {fmt}: {' '.join(str(e).split())}"
                ) from None
    datasets = table.datasets
    for p, d in zip(paths, datasets, strict=True):
        names = d.schema.names
        for key, column in _column_keys(spec):
            if column not in names:
                raise UsageError(
                    f"{p}: column {column!r} (spec {key}) is not in the data; its columns: "
                    f"{', '.join(names)}"
                )
            _check_type(p, key, column, d.schema.field(column).type)
    return table


SCALARS = "strings, integers, floats, booleans, decimals or dates"


def _check_type(path: Path, key: str, column: str, t: pa.DataType) -> None:
    """UsageError for a column type no spec key can take: nested values (a list of lists, a
    struct, a map) anywhere, lists outside a sparse feature. Scalars of the wrong kind for
    their key (text in a dense column) are reported per value, naming the row."""
    t = t.value_type if pa.types.is_dictionary(t) else t
    what = f"{path}: column {column!r} (spec {key}) holds {t}"
    if _is_list(t) and key.startswith("sparse["):
        inner = t.value_type
        inner = inner.value_type if pa.types.is_dictionary(inner) else inner
        if pa.types.is_nested(inner):
            raise UsageError(
                f"{what}, lists of {'lists' if _is_list(inner) else inner}; a sparse feature "
                f"takes one value (kind: single) or one flat list (kind: list) per row, of "
                f"{SCALARS}: flatten the column, or give each inner list a column of its own"
            )
    elif pa.types.is_nested(t):
        sparse = key.startswith("sparse[")
        if sparse:
            takes = f"{SCALARS} (kind: single) or lists of them (kind: list)"
        else:
            takes = "one number per row" if key.startswith(("dense[", "label.")) else "one value"
        fix = (
            "a list column can be a sparse feature (kind: list)"
            if _is_list(t) and not sparse
            else "move the field you need into a column of its own"
        )
        raise UsageError(f"{what}; {key.split('.')[0]} takes {takes}: {fix}")


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _column_keys(spec: DatasetSpec) -> list[tuple[str, str]]:
    keys = [("label.column", spec.label.column)]
    keys += [(f"dense[{i}].column", d.column) for i, d in enumerate(spec.dense)]
    keys += [(f"sparse[{i}] ({s.name}).column", s.column) for i, s in enumerate(spec.sparse)]
    if spec.split.by == "column":
        keys.append(("split.column", spec.split.column))
    return keys


class Splitter:
    """Split codes for consecutive batches in file order (see the module docstring)."""

    def __init__(self, split: SplitSpec, total_rows: int | None) -> None:
        self.split, self.seen = split, 0
        self.rng = np.random.default_rng(split.seed) if split.by == "fraction" else None
        if split.by == "rows":
            assert total_rows is not None
            self.n_train = int(np.floor(split.train_fraction * total_rows))
            self.n_val_end = self.n_train + (total_rows - self.n_train) // 2
        self._sets: dict[str, pa.Array] = {}

    def _value_set(self, name: str, values: list, column: pa.ChunkedArray | pa.Array) -> pa.Array:
        key = f"{name}:{column.type}"
        if key not in self._sets:
            t = column.type
            if pa.types.is_dictionary(t):
                t = t.value_type
            if pa.types.is_string(t) or pa.types.is_large_string(t):
                values = [v if isinstance(v, str) else str(v) for v in values]
            try:
                try:
                    self._sets[key] = pa.array(values, type=t)
                except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
                    self._sets[key] = pa.array(values).cast(t)  # "1" for an int column
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError):
                raise ValueError(
                    f"split.values.{name}: {values} cannot be compared with column "
                    f"{self.split.column!r} of type {t}"
                ) from None
        return self._sets[key]

    def codes(self, batch: pa.RecordBatch) -> np.ndarray:
        n, s = batch.num_rows, self.split
        start, self.seen = self.seen, self.seen + n
        if s.by == "rows":
            idx = np.arange(start, start + n)
            return np.where(idx < self.n_train, 0, np.where(idx < self.n_val_end, 1, 2)).astype(
                np.int8
            )
        if s.by == "fraction":
            u = self.rng.random(n)
            return np.where(u < s.val, 1, np.where(u < s.val + s.test, 2, 0)).astype(np.int8)
        import pyarrow.compute as pc

        col = batch.column(s.column)
        if pa.types.is_dictionary(col.type):
            col = col.dictionary_decode()
        out = np.full(n, -1, np.int8)
        for name, code in SPLIT_CODES.items():
            if s.values[name]:
                hit = pc.is_in(col, value_set=self._value_set(name, s.values[name], col))
                out[hit.to_numpy(zero_copy_only=False)] = code
        return out
