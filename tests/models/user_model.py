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
