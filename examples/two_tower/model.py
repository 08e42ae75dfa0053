"""A two-tower rating model, written as a user of hybridrec writes one: plain PyTorch around one
`hybridrec.EmbeddingTables`, trained by `hybridrec-train model._target_=model.TwoTower`
(run.sh). Its features are the dataset's (examples/two_tower/spec.yaml), named as there.

    user tower: user id, gender, occupation, zip prefix, the movies rated, age  -> [dim + 1]
    item tower: movie id, genres, the users who rated it, release year           -> [dim + 1]
    rating = <user[:dim], item[:dim]> + user[dim] + item[dim] + global bias

The last unit of each tower is its side's bias. The user and movie tables are shared: a user
id and the users who rated a movie look up the same rows, as do a movie id and the movies a
user rated.
"""

from __future__ import annotations

import torch
from torch import nn

import hybridrec

USER = ["user_id", "gender", "occupation", "zip_prefix", "user_movies"]
ITEM = ["movie_id", "genres", "movie_users"]
MEAN_RATING = 3.53  # of the train split: where the global bias starts


class TwoTower(nn.Module):
    task = "regression"

    def __init__(self, features, dim: int = 32, hidden: int = 128):
        """`features`: the dataset's features (name, rows, width, ids per sample, table)."""
        super().__init__()
        by_name = {f.name: f for f in features}
        tables = {f.table_name: f for f in features}
        self.tables = hybridrec.EmbeddingTables(
            [hybridrec.Table(t, f.num_rows, f.dim) for t, f in tables.items()],
            [
                hybridrec.Feature(
                    n,
                    by_name[n].table_name,
                    by_name[n].hotness,
                    by_name[n].pooling.value,
                    by_name[n].jagged,
                    by_name[n].mean_ids,
                )
                for n in USER + ITEM
            ],
        )
        user_in = sum(by_name[n].dim for n in USER) + 1  # + age
        item_in = sum(by_name[n].dim for n in ITEM) + 1  # + release year
        self.user = nn.Sequential(nn.Linear(user_in, hidden), nn.ReLU(), nn.Linear(hidden, dim + 1))
        self.item = nn.Sequential(nn.Linear(item_in, hidden), nn.ReLU(), nn.Linear(hidden, dim + 1))
        self.bias = nn.Parameter(torch.tensor(MEAN_RATING))
        self.dim = dim

    def forward(self, dense: torch.Tensor, ids: hybridrec.KeyedIds) -> torch.Tensor:
        pooled = self.tables(ids)
        u = self.user(torch.cat([*(pooled[n] for n in USER), dense[:, :1]], dim=1))
        v = self.item(torch.cat([*(pooled[n] for n in ITEM), dense[:, 1:]], dim=1))
        d = self.dim
        return (u[:, :d] * v[:, :d]).sum(1) + u[:, d] + v[:, d] + self.bias
