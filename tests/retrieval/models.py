"""Users' own models for the retrieval and own-loss tests, importable by `model._target_`."""

from __future__ import annotations

import torch
from torch import nn

import hybridrec
from hybridrec.model.retrieval import candidate_ids


class L2MF(nn.Module):
    """Biased matrix factorisation with its own loss: MSE + L2 on the rows each sample looked
    up (a mean over the rank's samples, as the own-loss contract asks), and on the global
    bias (a replicated weight: the same term on every rank). Its forward returns (ratings,
    the user rows, the item rows): the task scores the first."""

    task = "regression"

    def __init__(self, features, dim: int = 8, l2: float = 0.05):
        super().__init__()
        rows = {f.name: f.num_rows for f in features}
        self.users = hybridrec.EmbeddingTables([hybridrec.Table("user_id", rows["user_id"], dim)])
        self.items = hybridrec.EmbeddingTables([hybridrec.Table("item_id", rows["item_id"], dim)])
        self.user_bias = hybridrec.EmbeddingTables([hybridrec.Table("user_id", rows["user_id"], 1)])
        self.bias = nn.Parameter(torch.tensor(3.0))
        self.l2 = l2

    def forward(self, dense, ids):  # noqa: ANN001, ANN201
        u, v = self.users(ids)["user_id"], self.items(ids)["item_id"]
        b = self.user_bias(ids)["user_id"].squeeze(1)
        return (u * v).sum(1) + b + self.bias, u, v

    def loss(self, outputs, batch):  # noqa: ANN001, ANN201
        rating, u, v = outputs
        penalty = (u.square().sum(1) + v.square().sum(1)).mean() + self.bias.square()
        return batch.task_loss(outputs) + self.l2 * penalty


class RegularisedRetrieval(nn.Module):
    """A retrieval model of the user's own (query and candidates: embeddings through one
    linear layer each), its loss the task's in-batch softmax plus L2 on every vector it
    scored: the rows' own (a mean over the rank's samples) and the shared negatives'."""

    user_feature, item_feature = "user_id", "item_id"

    def __init__(self, features, dim: int = 8, l2: float = 0.01):
        super().__init__()
        rows = {f.name: f.num_rows for f in features}
        self.users = hybridrec.EmbeddingTables([hybridrec.Table("user_id", rows["user_id"], dim)])
        self.items = hybridrec.EmbeddingTables([hybridrec.Table("item_id", rows["item_id"], dim)])
        self.user_tower = nn.Linear(dim + 1, dim)
        self.item_tower = nn.Linear(dim, dim)
        self.l2 = l2

    def query(self, dense, ids):  # noqa: ANN001, ANN201
        return self.user_tower(torch.cat([self.users(ids)["user_id"], dense], dim=1))

    def candidates(self, item_ids):  # noqa: ANN001, ANN201
        return self.item_tower(self.items(item_ids.view(-1, 1))["item_id"])

    def forward(self, dense, ids, negatives=None):  # noqa: ANN001, ANN201
        items = candidate_ids(ids, self.item_feature, negatives)
        return self.query(dense, ids), self.candidates(items)

    def loss(self, outputs, batch):  # noqa: ANN001, ANN201
        query, candidates = outputs
        b = query.shape[0]
        own = (query.square().sum(1) + candidates[:b].square().sum(1)).mean()
        shared = candidates[b:].square().sum(1).mean() if candidates.shape[0] > b else 0.0
        return batch.task_loss(outputs) + self.l2 * (own + shared)


class DotOnly(nn.Module):
    """A dot product of a user and an item row: a scoring model, not a retrieval one (no
    query, candidates, user_feature or item_feature)."""

    def __init__(self, features, dim: int = 8):
        super().__init__()
        rows = {f.name: f.num_rows for f in features}
        self.tables = hybridrec.EmbeddingTables(
            [hybridrec.Table("user_id", rows["user_id"], dim),
             hybridrec.Table("item_id", rows["item_id"], dim)]
        )  # fmt: skip

    def forward(self, dense, ids):  # noqa: ANN001, ANN201
        pooled = self.tables(ids)
        return (pooled["user_id"] * pooled["item_id"]).sum(1)
