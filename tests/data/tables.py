"""Small user tables for the table-dataset tests, and plain-Python references for their ids."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from tests.configs import make_config

N = 40


def movies(n: int = N, start: int = 0) -> dict[str, list]:
    """Columns of a MovieLens-like table; rows start..start+n-1 (deterministic)."""
    rows = range(start, start + n)
    user = [None if i % 11 == 0 else f"u{i % 5}" for i in rows]
    if start == 0:
        user[3] = "rare"  # once in train: out of vocabulary with min_count 2
        user[-1] = "only_in_test"
    return {
        "rating": [1 + (i * 7) % 5 for i in rows],
        "age": [None if i % 9 == 4 else float(20 + (i * 13) % 30) for i in rows],
        "user": user,
        "movie": [None if i % 17 == 5 else i % 13 for i in rows],
        "zip": [None if i % 10 == 9 else (i % 3) * 100 + 1 for i in rows],
        "genres": [None if i % 7 == 0 else [f"g{(i + k) % 5}" for k in range(i % 4)] for i in rows],
    }


SPEC = {
    "label": {"column": "rating", "task": "binary", "rule": {"op": ">=", "value": 4}},
    "dense": [{"column": "age", "transform": "standardize"}],
    "sparse": [
        {"name": "user", "column": "user", "encoding": "vocabulary", "min_count": 2},
        {"name": "movie", "column": "movie", "encoding": "identity", "rows": 13},
        {"name": "zip", "column": "zip", "encoding": "hashing", "cap": 1000},
        {"name": "genres", "column": "genres", "kind": "list", "pooling": "mean"},
    ],
    "tables": [
        {"name": "user", "width": 8},
        {"name": "movie", "width": 8},
        {"name": "zip", "width": 8},
        {"name": "genres", "width": 8},
    ],
    "split": {"by": "rows", "train_fraction": 0.5},
}


def follows(n: int = N) -> dict[str, list]:
    """Columns of a table whose `user` (one id) and `followed` (a list of user ids) share the
    table `user`: "both" is seen once in each in train (kept only by the combined count of
    SHARED_SPEC's min_count 2), "rare" once in train, "u6" only in `followed`."""
    rows = range(n)
    user = [None if i % 11 == 0 else f"u{i % 5}" for i in rows]
    followed = [None if i % 7 == 0 else [f"u{(i + k) % 7}" for k in range(i % 4)] for i in rows]
    user[3], followed[6], followed[9] = "both", ["both", "u1"], ["rare", "u2"]
    user[-1] = "only_in_test"
    return {
        "clicked": [i % 3 == 0 for i in rows],
        "age": [float(20 + (i * 13) % 30) for i in rows],
        "user": user,
        "followed": followed,
    }


SHARED_SPEC = {
    "label": {"column": "clicked", "task": "binary"},
    "dense": [{"column": "age", "transform": "standardize"}],
    "sparse": [
        {"name": "user", "column": "user", "min_count": 2},
        {"name": "followed", "column": "followed", "kind": "list", "table": "user", "min_count": 2},
    ],
    "tables": [{"name": "user", "width": 8}],
    "split": {"by": "rows", "train_fraction": 0.5},
}


def spec_dict(**changes: object) -> dict:
    """A deep copy of SPEC with top-level keys replaced."""
    d = yaml.safe_load(yaml.safe_dump(SPEC))
    d.update(changes)
    return d


def write_spec(path: Path, d: dict) -> Path:
    path.write_text(yaml.safe_dump(d))
    return path


def write_parquet(path: Path, cols: dict[str, list], **kw: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path, **kw)
    return path


def write_csv(path: Path, cols: dict[str, list], delimiter: str = ",", lists: str = "|") -> Path:
    """A CSV with a header; None is an empty field, a list is joined by `lists`."""

    def cell(v: object) -> str:
        if v is None:
            return ""
        if isinstance(v, list):
            return lists.join(map(str, v))
        return str(v)

    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(cols)
    lines = [delimiter.join(names)]
    for r in range(len(cols[names[0]])):
        lines.append(delimiter.join(cell(cols[c][r]) for c in names))
    path.write_text("\n".join(lines) + "\n")
    return path


def vocab_ids(train_values: list, min_count: int = 1) -> dict:
    """Value -> id: 2.. by decreasing train count, then value (0 null, 1 out of vocabulary)."""
    counts = Counter(v for v in train_values if v is not None)
    kept = sorted((v for v, c in counts.items() if c >= min_count), key=lambda v: (-counts[v], v))
    return {v: i + 2 for i, v in enumerate(kept)}


def criteo_cfg(path: str, sharding: str, loader: str, world: int):
    overrides = [
        "data=criteo",
        f"data.path={path}",
        f"data.loader={loader}",
        "model=criteo_sample",
        f"sharding={sharding}",
        "train.batch_size=24",
        "eval.batch_size=6",
        "optim.dense.name=sgd",
        "optim.dense.lr=0.1",
        "device=cpu",
        "seed=3",
    ]
    return make_config(*overrides, world_size=world)


def dynamic_columns(n: int = 24) -> dict[str, list]:
    """Columns for DYNAMIC_SPEC: raw int64 users past 2^40 (one null), string items, int lists."""
    return {
        "clicked": [int(i % 3 == 0) for i in range(n)],
        "x": [float(i) for i in range(n)],
        "user": [None if i == 5 else (1 << 40) + 7 * (i % 9) for i in range(n)],
        "item": [f"item{i % 5}" for i in range(n)],
        "tags": [[(1 << 35) + i % 4, i % 3] if i % 4 else None for i in range(n)],
    }


DYNAMIC_SPEC = {  # a count-admitted user table in 8 buckets, item and tag tables by default
    "label": {"column": "clicked"},
    "dense": [{"column": "x"}],
    "sparse": [
        {
            "name": "user",
            "column": "user",
            "encoding": "dynamic",
            "capacity": 64,
            "min_count": 2,
            "policy": {"admit": "count", "evict": "lru", "buckets": 8},
        },
        {"name": "item", "column": "item", "encoding": "dynamic", "capacity": 128},
        {"name": "tags", "column": "tags", "kind": "list", "encoding": "dynamic", "capacity": 64},
    ],
    "tables": [
        {"name": "user", "width": 4},
        {"name": "item", "width": 4},
        {"name": "tags", "width": 4},
    ],
    "split": {"by": "rows", "train_fraction": 0.75},
}
