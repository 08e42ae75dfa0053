"""A user's own model, as a test defines it: importable as tests.models.user_model.TinyUser
(`model._target_=tests.models.user_model.TinyUser`)."""

from __future__ import annotations

import torch
from torch import nn

import hybridrec


class TinyUser(nn.Module):
    """Two collections over synthetic data's features (cat_0, cat_1 and cat_2..cat_5), the
    dense features through a linear layer, one logit."""

    task = "binary"

    def __init__(self, features, num_dense_features: int, dim: int = 8, hidden: int = 16):
        super().__init__()
        rows = {f.name: f.num_rows for f in features}
        self.a = hybridrec.EmbeddingTables(
            [hybridrec.Table("t0", rows["cat_0"], dim), hybridrec.Table("t1", rows["cat_1"], dim)],
            [hybridrec.Feature("cat_0", "t0"), hybridrec.Feature("cat_1", "t1")],
        )
        self.b = hybridrec.EmbeddingTables(
            [hybridrec.Table(n, rows[n], 4) for n in ("cat_2", "cat_3", "cat_4", "cat_5")]
        )
        self.dense = nn.Linear(num_dense_features, hidden)
        self.top = nn.Sequential(nn.ReLU(), nn.Linear(hidden + 2 * dim + 16, 1))

    def forward(self, dense: torch.Tensor, ids: hybridrec.KeyedIds) -> torch.Tensor:
        a, b = self.a(ids), self.b(ids)
        x = torch.cat([self.dense(dense), a.tensor.flatten(1), b.tensor.flatten(1)], dim=1)
        return self.top(x).squeeze(1)


class WrongHotness(nn.Module):
    """Reads cat_0 as 3 ids per sample (the data has 1)."""

    def __init__(self):
        super().__init__()
        self.t = hybridrec.EmbeddingTables(
            [hybridrec.Table("t", 5000, 4)], [hybridrec.Feature("cat_0", "t", hotness=3)]
        )

    def forward(self, dense, ids):
        return self.t(ids)["cat_0"].sum(1)


class Ratings(nn.Module):
    """A two-tower rating model over a table dataset's features `user` and `movie` + `genres`
    (a mean-pooled list), named as the dataset names them; regression."""

    task = "regression"

    def __init__(self, features, dim: int = 8):
        super().__init__()
        by = {f.name: f for f in features}
        g = by["genres"]
        self.users = hybridrec.EmbeddingTables([hybridrec.Table("user", by["user"].num_rows, dim)])
        self.items = hybridrec.EmbeddingTables(
            [
                hybridrec.Table("movie", by["movie"].num_rows, dim),
                hybridrec.Table("genres", g.num_rows, dim),
            ],
            [
                hybridrec.Feature("movie", "movie"),
                hybridrec.Feature("genres", "genres", g.hotness, "mean", jagged=True),
            ],
        )
        self.item = nn.Linear(2 * dim, dim)
        self.bias = nn.Parameter(torch.tensor(3.0))

    def forward(self, dense: torch.Tensor, ids: hybridrec.KeyedIds) -> torch.Tensor:
        u = self.users(ids)["user"]
        v = self.item(self.items(ids).tensor.flatten(1))
        return (u * v).sum(1) + self.bias


class NoTables(nn.Module):
    """Declares no EmbeddingTables at all."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(13, 1)


class EmptyTables(nn.Module):
    """Declares a collection with no tables."""

    def __init__(self):
        super().__init__()
        self.t = hybridrec.EmbeddingTables([])


class ShortTable(nn.Module):
    """cat_0's table holds 10 rows; the data's ids go up to 4999."""

    def __init__(self):
        super().__init__()
        self.t = hybridrec.EmbeddingTables(
            [hybridrec.Table("t", 10, 4)], [hybridrec.Feature("cat_0", "t")]
        )


class DynamicUser(nn.Module):
    """TinyUser with dynamic tables: cat_0 and cat_1 share a dynamic table smaller than their
    ids (LRU, an unknown row per bucket), cat_2 has one admitting ids seen twice (LFU);
    cat_3..cat_5 fixed. Synthetic data's ids serve as raw ids."""

    task = "binary"

    def __init__(self, features, num_dense_features: int, dim: int = 8):
        super().__init__()
        rows = {f.name: f.num_rows for f in features}
        lru = hybridrec.Dynamic(evict="lru", unknown="row", buckets=8)
        lfu = hybridrec.Dynamic(admit="count", min_count=2, evict="lfu", buckets=4)
        self.a = hybridrec.EmbeddingTables(
            [
                hybridrec.Table("shared", 64, dim, dynamic=lru),
                hybridrec.Table("c2", 32, dim, dynamic=lfu),
            ],
            [
                hybridrec.Feature("cat_0", "shared"),
                hybridrec.Feature("cat_1", "shared"),
                hybridrec.Feature("cat_2", "c2"),
            ],
        )
        self.b = hybridrec.EmbeddingTables(
            [hybridrec.Table(n, rows[n], dim) for n in ("cat_3", "cat_4", "cat_5")]
        )
        self.dense = nn.Linear(num_dense_features, dim)
        self.top = nn.Linear(7 * dim, 1)

    def forward(self, dense: torch.Tensor, ids: hybridrec.KeyedIds) -> torch.Tensor:
        x = torch.cat(
            [self.dense(dense), self.a(ids).tensor.flatten(1), self.b(ids).tensor.flatten(1)], 1
        )
        return self.top(x).squeeze(1)
