"""Preprocessing throughput of `hybridrec-preprocess --spec`, beside pyarrow's bare read.

One synthetic table (`--rows` rows: a 0/1 label, two float columns, one with nulls, a
Zipf-distributed string user id (vocabulary), an int item id (hashing), a small int country
(identity), and a list of 0-5 string tags (vocabulary, mean pooling)) is written once as
Parquet and once as CSV (tags joined by "|") to a temp dir. For each format:

- bare read: `pyarrow.dataset.dataset(path, format=...).to_table()`, the floor any reader
  of the file pays;
- preprocess: `hybridrec.data.tabular.preprocess_table` (both passes, encoding, assembly,
  checksums) into a fresh directory.

Each is timed `--repeat` times (the best counts); throughput is rows/s and input MB/s (file
bytes / seconds), and the ratio is preprocess time / bare read time.

    python -m benchmarks.preprocess_table --out benchmarks/results/preprocess_table_cpu.md
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from benchmarks.common import command_line, git_state, hardware, load_average, markdown_table
from hybridrec.data.spec import parse_spec
from hybridrec.data.tabular import preprocess_table

SPEC = {
    "label": {"column": "click"},
    "dense": [
        {"column": "price", "transform": "log1p"},
        {"column": "age", "transform": "standardize"},
    ],
    "sparse": [
        {"name": "user", "column": "user", "min_count": 2},
        {"name": "item", "column": "item", "encoding": "hashing", "cap": 100_000},
        {"name": "country", "column": "country", "encoding": "identity", "rows": 200},
        {"name": "tags", "column": "tags", "kind": "list", "pooling": "mean"},
    ],
    "tables": [{"name": n, "width": 16} for n in ("user", "item", "country", "tags")],
    "split": {"by": "fraction", "val": 0.05, "test": 0.05, "seed": 0},
}


def make_table(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    users = np.minimum(rng.zipf(1.2, rows), 200_000)
    n_tags = rng.integers(0, 6, rows)
    offsets = np.zeros(rows + 1, np.int32)
    np.cumsum(n_tags, out=offsets[1:])
    tag_values = pc.binary_join_element_wise(
        "t", pc.cast(pa.array(rng.integers(0, 500, int(offsets[-1]))), pa.string()), ""
    )
    age = rng.normal(35, 10, rows)
    return pa.table(
        {
            "click": rng.integers(0, 2, rows),
            "price": rng.lognormal(3, 1, rows),
            "age": pa.array(age, mask=rng.random(rows) < 0.05),
            "user": pc.binary_join_element_wise("u", pc.cast(pa.array(users), pa.string()), ""),
            "item": rng.integers(0, 10_000_000, rows),
            "country": rng.integers(0, 200, rows),
            "tags": pa.ListArray.from_arrays(pa.array(offsets), tag_values),
        }
    )


def write_inputs(table: pa.Table, root: Path) -> dict[str, Path]:
    pq_path = root / "table.parquet"
    pq.write_table(table, pq_path, row_group_size=131_072)
    csv_path = root / "table.csv"
    flat = table.set_column(
        table.schema.get_field_index("tags"), "tags", pc.binary_join(table["tags"], "|")
    )
    pacsv.write_csv(flat, csv_path)
    return {"parquet": pq_path, "csv": csv_path}


def best_of(repeat: int, fn) -> float:  # noqa: ANN001 - a callable of no arguments
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def lscpu_head() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "(lscpu not available)"
    return "\n".join(out.splitlines()[:10])


def run(rows: int, repeat: int, batch_rows: int, work: Path) -> list[list[object]]:
    paths = write_inputs(make_table(rows), work)
    spec = parse_spec(SPEC)
    out_rows = []
    for fmt, path in paths.items():
        size = path.stat().st_size
        bare = best_of(repeat, lambda p=path, f=fmt: ds.dataset(p, format=f).to_table())
        out = work / f"out_{fmt}"

        def prep(p: Path = path, o: Path = out) -> None:
            shutil.rmtree(o, ignore_errors=True)
            preprocess_table(spec, [p], o, batch_rows=batch_rows)

        t = best_of(repeat, prep)
        out_rows.append(
            [
                fmt,
                f"{size / 1e6:.1f}",
                f"{rows / bare:,.0f}",
                f"{size / 1e6 / bare:.1f}",
                f"{rows / t:,.0f}",
                f"{size / 1e6 / t:.1f}",
                f"{t / bare:.1f}x",
            ]
        )
    return out_rows


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=2, help="timings per case; the best counts")
    p.add_argument("--batch-rows", type=int, default=65536)
    p.add_argument("--out", default=None, help="write the markdown report here")
    args = p.parse_args(argv)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="hybridrec-bench-") as tmp:
        rows = run(args.rows, args.repeat, args.batch_rows, Path(tmp))
    headers = [
        "format",
        "file MB",
        "bare read rows/s",
        "bare read MB/s",
        "preprocess rows/s",
        "preprocess MB/s",
        "preprocess / bare read",
    ]
    text = "\n".join(
        [
            "# Preprocessing a table (hybridrec-preprocess --spec) on CPU",
            "",
            "Command (from the repository root):",
            "",
            "```bash",
            command_line(),
            "```",
            "",
            f"- Hardware: {hardware()}.",
            f"- Code: git {git_state()}.",
            f"- Load average (1, 5, 15 min) before: {load_before}; after: {load_average()} "
            "(a shared machine: other jobs ran too).",
            f"- Table: {args.rows:,} rows: 0/1 label, 2 floats (log1p, standardize), a Zipf "
            "string user id (vocabulary), an int item id (hashing, 100,000 rows), an int "
            "country (identity, 200), a list of 0-5 string tags (vocabulary); split by "
            f"fraction (5% val, 5% test); batches of {args.batch_rows:,} rows; best of "
            f"{args.repeat}.",
            "- Bare read: `pyarrow.dataset.dataset(path, format=...).to_table()` (pyarrow "
            f"{pa.__version__}, its own threads); preprocess: both passes, encoding, "
            "assembly with CRC32 per block, single-threaded Python around pyarrow.",
            "",
            markdown_table(headers, rows),
            "",
            "`lscpu | head`:",
            "",
            "```",
            lscpu_head(),
            "```",
            "",
        ]
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return text


if __name__ == "__main__":
    main()
