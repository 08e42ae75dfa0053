"""The model, data and loop of the sequence-feature tests (test_sequence_equivalence.py): a
user's ordered history of items (a sequence feature, one row per position, not pooled) that
shares the item table with the target item, a user id, and a jagged list of tags pooled by
mean. The model reads every position of the history with its own weight, so a wrong row, a
row at the wrong position or a lost gradient at any position shows in the loss and the rows.
The item table may be dynamic (raw 40-bit ids)."""

from __future__ import annotations

import torch
from torch import nn

import hybridrec
from hybridrec import Dynamic, EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.planner import CachePolicy
from hybridrec.sparse.api import embedding_modules
from tests.libmodel import OPTIMIZERS, assemble_tables, step_mean_loss, unwrap

B, STEPS, L = 24, 4, 6
FEATURES = [("history", L), ("target", 1), ("user_id", 1), ("tags", 3)]
ROWS = {"items.item": 240, "users.user": 50, "users.tag": 30}
DIMS = {"items.item": 8, "users.user": 8, "users.tag": 4}
DYNAMIC = Dynamic(admit="always", evict="lru", unknown="row", buckets=8)


class Sequential(nn.Module):
    """History rows [B, L, 8] weighted per position, the target's row, user and tags."""

    def __init__(self, dynamic: bool) -> None:
        super().__init__()
        item = Table("item", ROWS["items.item"], 8, dynamic=DYNAMIC if dynamic else None)
        self.items = EmbeddingTables(
            [item],
            [Feature("history", "item", hotness=L, pooling="none"), Feature("target", "item")],
        )
        self.users = EmbeddingTables(
            [Table("user", ROWS["users.user"], 8), Table("tag", ROWS["users.tag"], 4)],
            [Feature("user_id", "user"), Feature("tags", "tag", 3, jagged=True, pooling="mean")],
        )
        self.position = nn.Parameter(torch.linspace(0.5, 1.5, L).view(1, L, 1))
        self.mix = nn.Linear(8 + 8 + 4, 8)

    def forward(self, dense: torch.Tensor, ids: KeyedIds) -> torch.Tensor:
        i, u = self.items(ids), self.users(ids)
        history = i["history"]  # [B, L, 8], zeros past each history's end
        mask = i.mask("history").float().unsqueeze(2)
        read = (history * self.position * mask).sum(1) / mask.sum(1).clamp(min=1)
        user = self.mix(torch.cat([read, u["user_id"], u["tags"]], dim=1))
        return (user * i["target"]).sum(1) + dense.sum(1)


def batches(
    dynamic: bool, steps: int = STEPS
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`steps` global batches: histories of 0..L items (padding after the last, and now and
    then a gap), skewed so rows repeat across positions and samples."""
    g = torch.Generator().manual_seed(5)
    raw = torch.randint(0, 1 << 40, (400,), generator=torch.Generator().manual_seed(9))
    out = []
    for _ in range(steps):
        items = (torch.rand(B, L + 1, generator=g) ** 2 * ROWS["items.item"]).long()
        if dynamic:  # raw ids from a pool larger than the table: admissions and evictions
            items = raw[(torch.rand(B, L + 1, generator=g) ** 2 * raw.numel()).long()]
        history, target = items[:, :L].clone(), items[:, L:]
        length = torch.randint(0, L + 1, (B, 1), generator=g)
        history[torch.arange(L).expand(B, L) >= length] = -1
        history[torch.rand(B, L, generator=g) < 0.1] = -1  # gaps inside a sequence too
        tags = torch.randint(0, ROWS["users.tag"], (B, 3), generator=g)
        tags[torch.rand(B, 3, generator=g) < 0.3] = -1
        user = torch.randint(0, ROWS["users.user"], (B, 1), generator=g)
        ids = torch.cat([history, target, user, tags], 1)
        labels = (torch.rand(B, generator=g) < 0.4).float()
        out.append((torch.randn(B, 2, generator=g), ids, labels))
    return out


def train(group, sharding: str, pins, sparse: str, dynamic: bool = False) -> dict:  # noqa: ANN001
    torch.manual_seed(0)
    model = hybridrec.parallelize(
        Sequential(dynamic),
        batch_size=B,
        sparse_optimizer=OPTIMIZERS[sparse](),
        group=group,
        sharding=sharding,
        pins=pins,
        cache=CachePolicy(fraction=0.1),
        seed=11,
    )
    world = group.size() if group is not None else 1
    rank = group.rank() if group is not None else 0
    part = slice(rank * B // world, (rank + 1) * B // world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [
        step_mean_loss(model, opt, group, dense[part], ids[part], labels[part], FEATURES)
        for dense, ids, labels in batches(dynamic)
    ]
    inner = unwrap(model)
    for m in embedding_modules(inner):
        for g in m.host_groups():
            g.flush()
    return {
        "losses": losses,
        "shards": [
            (spec, w.clone(), {k: v.clone() for k, v in st.items()})
            for m in embedding_modules(inner)
            for spec, w, st in m.shard_views()
        ],
        "dense": {k: v.detach().clone() for k, v in inner.named_parameters()},
    }


def full_tables(results: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    return assemble_tables(results, ROWS, DIMS)
