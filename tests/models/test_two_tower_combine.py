"""two_tower's `combine=sum`: the user tower adds its features' vectors (a user id plus the mean
of the items it met before, as SVD++) where `concat` joins them. Each tower declares its own
tables, so the history's rows are the user tower's table of the movie ids (users.movie), apart
from the item tower's (items.movie)."""

from __future__ import annotations

import pytest
import torch

import hybridrec
from hybridrec.model.zoo import TwoTower
from hybridrec.optim.sparse import SparseSGD
from hybridrec.types import KeyedIds, Pooling, TableConfig

FEATURES = [
    TableConfig("user", 10, 4),
    TableConfig("movie", 20, 4),
    TableConfig("history", 20, 4, hotness=3, jagged=True, pooling=Pooling.MEAN, storage="movie"),
]
IDS = torch.tensor(
    [[1, 5, 2, 7, -1], [3, 6, -1, -1, -1], [9, 19, 4, 4, 11]]
)  # user, movie, history
NAMES, HOTNESS = [f.name for f in FEATURES], [f.hotness for f in FEATURES]


def _tower(combine: str) -> torch.nn.Module:
    net = TwoTower(FEATURES, ["user", "history"], ["movie"], [], task="retrieval", combine=combine)
    return hybridrec.parallelize(
        net, batch_size=3, sparse_optimizer=SparseSGD(0.1), sharding="none", seed=3
    )


def test_sum_adds_the_user_row_and_the_mean_of_the_history_rows():
    keyed = KeyedIds(IDS, NAMES, HOTNESS)
    model = _tower("sum")
    with torch.no_grad():
        query = model.query(torch.zeros(3, 0), keyed)
        parts = model.users(keyed)  # each feature's pooled vector, [3, 4]
        one = torch.full((20, 5), -1)
        one[:, 0], one[:, 1], one[:, 2] = 0, 0, torch.arange(20)  # a history of one movie each
        rows = model.users(KeyedIds(one, NAMES, HOTNESS))["history"]  # users.movie's rows
        items = model.candidates(torch.arange(20))  # items.movie: the item tower's own table
    assert query.shape == (3, 4)
    torch.testing.assert_close(query, parts["user"] + parts["history"], rtol=0, atol=0)
    means = torch.stack([rows[[2, 7]].mean(0), torch.zeros(4), rows[[4, 4, 11]].mean(0)])
    torch.testing.assert_close(parts["history"], means, rtol=0, atol=1e-6)  # empty: zeros
    assert parts["user"].abs().sum() > 0 and means.abs().sum() > 0
    assert not torch.equal(rows, items)  # the history's table is the user tower's (SVD++'s y_j)


def test_sum_needs_one_width_and_a_known_mode():
    wide = [FEATURES[0], FEATURES[1], TableConfig("genre", 5, 8)]
    with pytest.raises(ValueError, match="combine=sum adds the user features' vectors"):
        TwoTower(wide, ["user", "genre"], ["movie"], [], task="retrieval", combine="sum")
    with pytest.raises(ValueError, match="combine must be concat or sum"):
        TwoTower(FEATURES, ["user"], ["movie"], [], combine="mean")
