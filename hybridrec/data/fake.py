"""Fake raw Criteo day files, for tests, benchmarks and trying the pipeline without the data.

`write_fake_day(path, rows)` writes a TSV in the raw Criteo layout (label, 13 integer fields,
26 8-digit hex fields; ~15% of fields empty, some negative integers), gzip-compressed when
the path ends in .gz. Ids are Zipf-like over per-table vocabularies of `cardinalities` values
(a table's popularity rank k maps to a fixed 32-bit value), so frequency thresholds and id
counts behave as on real data. Built with pyarrow's CSV writer, a few hundred MB/s: fine for
multi-GB files. `python -m hybridrec.data.fake OUT_DIR DAYS ROWS_PER_DAY` writes day_0..
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from hybridrec.data.criteo import NUM_CAT, NUM_DENSE

DEFAULT_CARDINALITIES = [
    1000, 500, 200_000, 100_000, 300, 24, 12_000, 600, 3, 90_000, 5_000, 200_000, 3_000,
    27, 15_000, 200_000, 10, 5_000, 2_000, 4, 200_000, 18, 15, 100_000, 100, 100_000,
]  # fmt: skip
_HEXCHARS = np.frombuffer(b"0123456789abcdef", np.uint8)


def _hex8(values: np.ndarray) -> pa.Array:
    """[n] uint32 -> string array of 8-digit lowercase hex."""
    shifts = np.arange(28, -4, -4, dtype=np.uint32)
    nibbles = (values[:, None] >> shifts) & 0xF
    chars = np.ascontiguousarray(_HEXCHARS[nibbles])
    return pa.array(chars.view("S8").reshape(-1), pa.binary()).cast(pa.string())


def _with_empty(arr: pa.Array, empty: np.ndarray) -> pa.Array:
    return pc.if_else(pa.array(empty), pa.scalar("", pa.string()), arr.cast(pa.string()))


def fake_chunk(
    rows: int, rng: np.random.Generator, cardinalities: list[int] | None = None
) -> pa.Table:
    cards = cardinalities or DEFAULT_CARDINALITIES
    cols: dict[str, pa.Array] = {}
    dense = np.floor(np.exp(rng.normal(1.0, 1.6, (rows, NUM_DENSE)))).astype(np.int64)
    dense[:, 1] -= 2  # I2 is sometimes negative in the real data
    logit = 0.4 * np.log1p(np.maximum(dense[:, 0], 0)) - 1.5
    cat_keys = []
    for t, card in enumerate(cards):
        rank = np.floor(np.exp(rng.random(rows) * np.log(card + 1.0))).astype(np.int64) - 1
        cat_keys.append(rank)
        logit += 0.3 * ((rank * 2654435761 + t) % 7 == 0)
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    cols["label"] = pa.array(labels).cast(pa.string())
    for j in range(NUM_DENSE):
        empty = rng.random(rows) < 0.15
        cols[f"I{j + 1}"] = _with_empty(pa.array(dense[:, j]).cast(pa.string()), empty)
    for t, rank in enumerate(cat_keys):
        value = ((rank * 2654435761 + t * 40503 + 12345) % (1 << 32)).astype(np.uint32)
        empty = rng.random(rows) < 0.1
        cols[f"C{t + 1}"] = _with_empty(_hex8(value), empty)
    return pa.table(cols)


def write_fake_day(
    path: str | Path,
    rows: int,
    seed: int = 0,
    cardinalities: list[int] | None = None,
    chunk_rows: int = 200_000,
) -> Path:
    """Write `rows` fake raw rows to `path` (gzip if it ends in .gz); returns the path."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    compression = "gzip" if path.suffix == ".gz" else None
    assert len(cardinalities or DEFAULT_CARDINALITIES) == NUM_CAT
    with pa.output_stream(str(path), compression=compression) as out:
        done = 0
        while done < rows:
            n = min(chunk_rows, rows - done)
            pacsv.write_csv(fake_chunk(n, rng, cardinalities), out, options)
            done += n
    return path


def main() -> None:
    p = argparse.ArgumentParser(description="write fake raw Criteo day files day_0 .. day_{N-1}")
    p.add_argument("out_dir")
    p.add_argument("days", type=int)
    p.add_argument("rows_per_day", type=int)
    p.add_argument("--gzip", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    Path(a.out_dir).mkdir(parents=True, exist_ok=True)
    for d in range(a.days):
        name = f"day_{d}" + (".gz" if a.gzip else "")
        print(write_fake_day(Path(a.out_dir) / name, a.rows_per_day, a.seed + d))


if __name__ == "__main__":
    main()
