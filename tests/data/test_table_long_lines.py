"""A CSV line longer than pyarrow's 1 MiB read block (issue 41): preprocessing used to stop with
pyarrow's "straddling object straddles two block boundaries", naming no file or row, and no
key could change the block. Now the block grows (scan.CSV_BLOCKS) and the file is read again
from its start, skipping the rows already read: the dataset is the one the same rows give as
Parquet. A line longer than the largest block is one line naming the file and its row."""

from __future__ import annotations

import logging
import re

import numpy as np
import pyarrow as pa
import pytest

from hybridrec.data.dataset import open_dataset
from hybridrec.data.preprocess_cli import main as preprocess_main
from hybridrec.data.spec import parse_spec
from hybridrec.data.tabular import preprocess_table, scan
from tests.data.tables import movies, spec_dict, write_csv, write_parquet, write_spec


def _arrays(path) -> list[np.ndarray]:
    ds = open_dataset(path)
    return [np.asarray(ds.labels), np.asarray(ds.dense), np.asarray(ds.categorical)]


def _long_user(n: int, row: int, length: int) -> dict[str, list]:
    cols = movies(n)
    cols["user"][row - 1] = "x" * length  # data row `row`, 1-based
    return cols


@pytest.mark.parametrize(
    "row, split",
    [
        (20, {"by": "rows", "train_fraction": 0.5}),  # first block (read when opening) + count
        (38000, {"by": "fraction", "val": 0.1, "test": 0.1, "seed": 3}),  # a later block
    ],
)
def test_a_line_longer_than_the_read_block_is_read(tmp_path, row, split, caplog):
    cols = _long_user(40000, row, 2_500_000)  # pyarrow fails on lines over about 2 blocks
    spec = parse_spec(spec_dict(split=split))
    src = write_csv(tmp_path / "m.csv", cols)
    assert src.stat().st_size > 3_000_000
    with caplog.at_level(logging.WARNING, logger=scan.__name__):
        preprocess_table(spec, [src], tmp_path / "csv", batch_rows=4096)
    grew = [r.getMessage() for r in caplog.records if r.name == scan.__name__]
    assert grew and all(
        re.fullmatch(
            rf"{re.escape(str(src))}: a line( after row \d+)? is longer than 1 MiB; reading "
            r"with 4 MiB blocks",
            m,
        )
        for m in grew
    ), grew
    assert len(grew) == 1  # the larger block is kept for every later read
    # the same rows as Parquet (no blocks of text): the same dataset, bit for bit
    cols["movie"] = [None if v is None else str(v) for v in cols["movie"]]  # CSV's text
    cols["zip"] = [None if v is None else str(v) for v in cols["zip"]]
    ref = write_parquet(tmp_path / "m.parquet", cols)
    preprocess_table(spec, [ref], tmp_path / "pq", batch_rows=4096)
    for got, want in zip(_arrays(tmp_path / "csv"), _arrays(tmp_path / "pq"), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_line_longer_than_the_largest_block_names_the_file_and_row(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(scan, "CSV_BLOCKS", (1 << 16, 1 << 18))
    src = write_csv(tmp_path / "m.csv", _long_user(40000, 30000, 600_000))
    spec = write_spec(tmp_path / "s.yaml", spec_dict())
    argv = ["--spec", str(spec), "--input", str(src), "--output", str(tmp_path / "out")]
    assert preprocess_main(argv) == 1
    err = capsys.readouterr().err.strip().split("\n")
    assert err[-1] == (
        f"hybridrec-preprocess: error: {src}: row 30000 is longer than 0.25 MiB, the largest CSV "
        "block read; shorten that field (split a long list over rows or columns) or convert the "
        "file to Parquet"
    )
    assert not (tmp_path / "out").exists()


def test_a_read_that_fails_midway_resumes_after_the_rows_already_read(tmp_path, monkeypatch):
    """pyarrow reads ahead, so on these small files the straddle error comes before the first
    batch; on a large one it comes after batches were handed out. Such a read, failing after
    three batches, is read again with the larger block and skips what was handed out: every
    row once, in order, the dataset the uninterrupted read gives."""
    src = write_csv(tmp_path / "m.csv", movies(20000))
    spec = parse_spec(spec_dict(split={"by": "fraction", "seed": 1}))
    preprocess_table(spec, [src], tmp_path / "ref", batch_rows=1000)
    current, failed = scan.Table._current, []

    class FailsMidway:
        def __init__(self, frag):
            self.frag = frag

        def to_batches(self, **kw):
            for i, b in enumerate(self.frag.to_batches(**kw)):
                if i == 3:
                    failed.append(i)
                    raise pa.ArrowInvalid("straddling object straddles two block boundaries")
                yield b

    def first_read_fails(self, frag):
        return current(self, frag) if self.block else FailsMidway(frag)

    monkeypatch.setattr(scan.Table, "_current", first_read_fails)
    preprocess_table(spec, [src], tmp_path / "out", batch_rows=1000)
    assert failed == [3]  # the first pass failed midway once, then read 4 MiB blocks
    for got, want in zip(_arrays(tmp_path / "out"), _arrays(tmp_path / "ref"), strict=True):
        np.testing.assert_array_equal(got, want)
