"""Built-in models written with the library API (EmbeddingTables + plain PyTorch).

Both take the dataset's features (`features`: one TableConfig per sparse feature, as
ModelConfig.tables() gives them) and look them up by name in `forward(dense, ids: KeyedIds)`,
returning one raw output per sample, [B] fp32; the loss is model.task's (hybridrec.model.task).

- TwoTower: a user tower and an item tower, each the embeddings of its features
  (`user_features`, `item_features`: lists of feature names) through an MLP (`tower_mlp`;
  empty: the concatenated embeddings; `normalize`: unit-length vectors, a cosine score).
  `combine=sum` adds the user tower's vectors instead of concatenating them (each as wide as
  the item tower): a user id plus the mean of the items it met before, as SVD++ does (the
  history a list feature of item ids, its rows the user tower's own table, `users.<table>`);
  scored as dot(user, item) + user bias + item bias + global bias. The biases are width-1
  tables over the same features (sum-pooled), "user_bias.<table>" and "item_bias.<table>";
  the global bias is a dense weight (the dense optimizer's), starting at `label_mean` (the
  train split's mean label, which data=table gives a regression model; else 0). Dense
  features are not used. The collaborative-filtering model (biased matrix factorisation
  with `tower_mlp=[]`). With model.task=retrieval it is a retrieval model
  (hybridrec.model.retrieval: no biases, one item feature, the item id, whose ids are the
  catalogue; the first user feature names the user): forward returns (query, candidates).
- WideDeep: wide = width-1 tables, one per table, sum-pooled (a linear model over the sparse
  features) + a linear layer over the dense features; deep = the dataset's embeddings and the
  dense features through an MLP (`deep_mlp`, then one output). Output = wide + deep.

Qualified table names (plans, checkpoints, exports): "users.<table>", "user_bias.<table>",
"items.<table>", "item_bias.<table>"; "wide.<table>", "deep.<table>".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from hybridrec.model.mlp import MLP
from hybridrec.model.retrieval import candidate_ids
from hybridrec.model.tables import EmbeddingTables
from hybridrec.types import KeyedIds, Pooling, TableConfig


def mirror(
    features: Sequence[TableConfig], names: Sequence[str], dim: int | None = None, pool="sum"
) -> EmbeddingTables:
    """EmbeddingTables over the dataset features `names` with their tables' rows: widths as
    the dataset's (or `dim` for all), pooling as the dataset's (or `pool` when `dim` is set)."""
    by_name = {f.name: f for f in features}
    chosen = [by_name[n] for n in names]
    if dim is not None:
        chosen = [dataclasses.replace(f, dim=dim, pooling=Pooling(pool)) for f in chosen]
    return EmbeddingTables.of(chosen)


def _feature_list(key: str, value: object, known: Sequence[str]) -> list[str]:
    names = [value] if isinstance(value, str) else list(value or [])  # type: ignore[arg-type]
    if not names:
        raise ValueError(
            f"model.args.{key} must list the features of that tower (of {list(known)}), e.g. "
            f"+model.args.{key}=[{known[0]}]"
        )
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"model.args.{key}: {unknown} are not features of the dataset; its features are "
            f"{list(known)}"
        )
    return names


class TwoTower(nn.Module):
    """User tower . item tower (+ biases for binary and regression; module docstring)."""

    def __init__(
        self,
        features: Sequence[TableConfig],
        user_features: Sequence[str] | str = (),
        item_features: Sequence[str] | str = (),
        tower_mlp: Sequence[int] = (64, 32),
        task: str = "binary",
        normalize: bool = False,
        label_mean: float | None = None,
        combine: str = "concat",
    ) -> None:
        super().__init__()
        if combine not in ("concat", "sum"):
            raise ValueError(f"model.args.combine must be concat or sum, got {combine!r}")
        self.combine = combine
        known = [f.name for f in features]
        users = _feature_list("user_features", user_features, known)
        items = _feature_list("item_features", item_features, known)
        self.retrieval = task == "retrieval"
        if self.retrieval and len(items) != 1:
            raise ValueError(
                f"two_tower with model.task=retrieval: the item tower reads one feature, the "
                f"item id (its ids are the catalogue), got model.args.item_features={items}"
            )
        both = sorted(set(users) & set(items))
        if both:
            raise ValueError(f"model.args: features {both} are in both towers; give each one")
        self.user_feature, self.item_feature = users[0], items[0]
        self.normalize = bool(normalize)
        self.users, self.items = mirror(features, users), mirror(features, items)
        if not self.retrieval:  # a softmax over items ignores a user's bias
            self.user_bias, self.item_bias = mirror(features, users, 1), mirror(features, items, 1)
        widths = [sum(f.dim for f in t.features) for t in (self.users, self.items)]
        if combine == "sum":
            dims = {f.name: f.dim for f in self.users.features}
            if len(set(dims.values())) > 1:
                raise ValueError(
                    f"model.args.combine=sum adds the user features' vectors, which need one "
                    f"width; got {dims}: give their tables one width or use combine=concat"
                )
            widths[0] = next(iter(dims.values()))
        tower = list(tower_mlp)
        if not tower and widths[0] != widths[1]:
            raise ValueError(
                f"two_tower: the user tower is {widths[0]} wide and the item tower {widths[1]}; "
                "the dot product needs one width: give model.args.tower_mlp (e.g. [64, 32])"
            )
        if any(w < 1 for w in tower):
            raise ValueError(f"model.args.tower_mlp widths must be >= 1, got {tower}")
        self.user_mlp = MLP(widths[0], tower, final_relu=False) if tower else nn.Identity()
        self.item_mlp = MLP(widths[1], tower, final_relu=False) if tower else nn.Identity()
        if not self.retrieval:  # the global bias: from the mean label, not from 0
            self.bias = nn.Parameter(torch.tensor(float(label_mean or 0.0)))

    def query(self, dense: torch.Tensor, ids: KeyedIds) -> torch.Tensor:
        """The user tower: [b, D] (unit length with `normalize`)."""
        pooled = self.users(ids).tensor  # [b, F, D] at one width (combine=sum's), else [b, sum D]
        u = self.user_mlp(pooled.sum(1) if self.combine == "sum" else pooled.flatten(1))
        return nn.functional.normalize(u, dim=1) if self.normalize else u

    def candidates(self, item_ids: torch.Tensor) -> torch.Tensor:
        """The item tower of item ids [n]: [n, D] (unit length with `normalize`)."""
        v = self.item_mlp(self.items(item_ids.view(-1, 1)).tensor.flatten(1))
        return nn.functional.normalize(v, dim=1) if self.normalize else v

    def forward(
        self, dense: torch.Tensor, ids: KeyedIds, negatives: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.retrieval:  # (query [b, D], candidates [b + M, D]): hybridrec.model.retrieval
            items = candidate_ids(ids, self.item_feature, negatives).view(-1)
            return self.query(dense, ids), self.candidates(items)
        u = self.query(dense, ids)
        v = self.item_mlp(self.items(ids).tensor.flatten(1))
        if self.normalize:
            v = nn.functional.normalize(v, dim=1)
        bias = self.user_bias(ids).tensor.flatten(1).sum(1) + self.item_bias(ids).tensor.flatten(
            1
        ).sum(1)
        return (u * v).sum(1) + bias + self.bias


class WideDeep(nn.Module):
    """Wide (linear) + deep (MLP) logits (module docstring)."""

    def __init__(
        self,
        features: Sequence[TableConfig],
        num_dense_features: int,
        deep_mlp: Sequence[int] = (64, 32),
    ) -> None:
        super().__init__()
        names = [f.name for f in features]
        if any(w < 1 for w in deep_mlp):
            raise ValueError(f"model.args.deep_mlp widths must be >= 1, got {list(deep_mlp)}")
        self.wide = mirror(features, names, 1)
        self.wide_dense = nn.Linear(num_dense_features, 1)
        self.deep = mirror(features, names)
        width = num_dense_features + sum(f.dim for f in self.deep.features)
        self.deep_mlp = MLP(width, [*deep_mlp, 1], final_relu=False)

    def forward(self, dense: torch.Tensor, ids: KeyedIds) -> torch.Tensor:
        wide = self.wide(ids).tensor.flatten(1).sum(1) + self.wide_dense(dense).squeeze(1)
        deep = torch.cat([dense, self.deep(ids).tensor.flatten(1)], dim=1)
        return wide + self.deep_mlp(deep).squeeze(1)
