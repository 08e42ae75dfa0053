"""benchmarks/retrieval_baselines.py: the rank of a held-out item (seen items excluded, ties
by movie_id) equals its position in a plain sorted list, HR@K and NDCG@K follow from it, and on
the real MovieLens split the deterministic anchors give issue 32's figures."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from benchmarks.retrieval_baselines import ease, evaluate, load, metrics, popularity, ranks

ROOT = Path(__file__).resolve().parents[2]


def test_rank_is_the_position_in_the_sorted_unexcluded_items():
    rng = np.random.default_rng(0)
    users, items = 50, 30
    scores = rng.integers(0, 5, (users, items)).astype(np.float32)  # many ties
    exclude = rng.random((users, items)) < 0.3
    held = np.array([rng.choice(np.flatnonzero(~row)) for row in exclude])
    got = ranks(scores, held, exclude)
    for u in range(users):
        kept = [i for i in range(items) if not exclude[u, i]]
        order = sorted(kept, key=lambda i: (-scores[u, i], i))  # high first, ties by id
        assert got[u] == order.index(held[u])
    with pytest.raises(ValueError, match="held-out item is among the excluded"):
        exclude[0, held[0]] = True
        ranks(scores, held, exclude)
    with pytest.raises(ValueError, match="scores must be finite"):
        ranks(np.full((users, items), np.nan), held, np.zeros_like(exclude))


def test_hr_and_ndcg_from_ranks():
    rank = np.array([0, 3, 9, 10, 49, 50])
    m = metrics(rank)
    assert m["hr@10"] == 3 / 6 and m["hr@50"] == 5 / 6
    want = (1 / math.log2(2) + 1 / math.log2(5) + 1 / math.log2(11)) / 6
    assert m["ndcg@10"] == pytest.approx(want, rel=1e-12)


def test_real_movielens_popularity_and_ease_give_the_issue_figures(tmp_path, movielens_wheel):
    prepare = runpy.run_path(str(ROOT / "examples" / "retrieval" / "prepare.py"))
    prepare["prepare"](tmp_path, movielens_wheel)
    split = load(tmp_path)
    assert split.train.shape == (943, 1682) and split.train.sum() == 98_114
    for model, want in ((popularity, (0.0498, 0.0254, 0.1410)), (ease, (0.0817, 0.0371, 0.2980))):
        test = evaluate(model(split, 0), split)["test"]
        got = (test["hr@10"], test["ndcg@10"], test["hr@50"])
        assert got == pytest.approx(want, abs=5e-5), model.__name__


def test_real_movielens_als_and_bpr_with_random_state_0_give_the_issue_figures(
    tmp_path, movielens_wheel
):
    """implicit's ALS and BPR (the benchmark's settings, random_state 0, one thread) give
    issue 32's figures to the last digit: the issue measured these settings and seed."""
    pytest.importorskip("implicit")
    from benchmarks.retrieval_baselines import als, bpr

    prepare = runpy.run_path(str(ROOT / "examples" / "retrieval" / "prepare.py"))
    prepare["prepare"](tmp_path, movielens_wheel)
    split = load(tmp_path)
    for model, want in ((als, (0.0753, 0.0355, 0.2906)), (bpr, (0.0721, 0.0341, 0.2577))):
        test = evaluate(model(split, 0), split)["test"]
        got = (test["hr@10"], test["ndcg@10"], test["hr@50"])
        assert got == pytest.approx(want, abs=5e-5), model.__name__


def test_two_tower_is_seeded_and_learns_which_items_a_user_likes():
    """The plain two-tower: [U, I] scores, the same for the same seed; on two groups of users
    who each name only their group's items, every user scores their group's items above the
    other group's."""
    from benchmarks.retrieval_baselines import Split, two_tower

    users, items = 40, 20
    group = np.arange(users) % 2
    train = np.zeros((users, items), bool)
    for u in range(users):
        train[u, np.arange(group[u], items, 2)] = True  # group g names items g, g + 2, ...
    split = Split(np.arange(1, users + 1), np.arange(1, items + 1), train, group, 1 - group)
    scores = two_tower(split, 0, dim=8, epochs=30, batch=64)
    assert scores.shape == (users, items)
    np.testing.assert_array_equal(scores, two_tower(split, 0, dim=8, epochs=30, batch=64))
    own = np.where(train, scores, np.inf).min(1)
    other = np.where(train, -np.inf, scores).max(1)
    assert (own > other).all()


def test_main_on_a_min_rating_split_names_it_and_runs_the_chosen_models(tmp_path):
    """`--models` runs only the models named; the result names the split's --min-rating."""
    from benchmarks.retrieval_baselines import main
    from tests.data.movielens import fake_wheel

    prepare = runpy.run_path(str(ROOT / "examples" / "retrieval" / "prepare.py"))
    users = [1, 1, 1, 2, 2, 2, 3, 3, 3]  # user 3 rated 3 stars only: left out at 4
    ratings = pa.table({"user_id": users, "movie_id": [10, 20, 30] * 3,
                        "rating": [5, 4, 5, 4, 5, 5, 3, 3, 3], "timestamp": list(range(9))})  # fmt: skip
    prepare["prepare"](tmp_path / "d", fake_wheel(tmp_path / "f.whl", ratings), 4)
    out = tmp_path / "r.md"
    assert (
        main(["--data", str(tmp_path / "d"), "--models", "popularity", "EASE", "--out", str(out)])
        == 0
    )
    text = out.read_text()
    assert "prepare.py " + str(tmp_path / "d") + " --min-rating 4`" in text
    assert "the ratings of 4 stars or more" in text
    rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]
    assert rows == ["model", "popularity", "EASE"]
