"""The model, data and training loop of the dynamic-table tests (test_dynamic_*.py): a user
side (a dynamic user table that a user id and a jagged, mean-pooled list of friends share, and
a fixed age table) and an item side (a dynamic item table), trained on raw 40-bit ids drawn
with skew from pools far larger than the tables, drifting from step to step."""

from __future__ import annotations

import torch
from torch import nn

from hybridrec import Dynamic, EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.sparse.api import EmbeddingCounters, embedding_modules
from tests.libmodel import (
    B,
    assemble_tables,
    parallelized,
    rank_slice,
    shard_copies,
    step_mean_loss,
    unwrap,
)

STEPS = 6  # batches of B (tests.libmodel's, as its parallelized and rank_slice take)
FEATURES = [("user_id", 1), ("friends", 4), ("age", 1), ("item_id", 1)]
ROWS = {"users.user": 64, "users.age": 7, "items.item": 48}
DIMS = {"users.user": 8, "users.age": 8, "items.item": 8}
POOLS = {"user": 400, "item": 300}  # distinct raw ids per side (tables hold 56-64)
POLICIES = {
    "lfu": (
        Dynamic(admit="count", min_count=2, evict="lfu", halflife=2, unknown="row", buckets=8),
        Dynamic(admit="always", evict="lru", buckets=4),
    ),
    "ttl": (
        Dynamic(admit="probability", probability=0.7, evict="ttl", ttl_steps=2, buckets=8),
        Dynamic(admit="always", evict="ttl", ttl_steps=1, unknown="row", buckets=6),
    ),
}


class TwoSided(nn.Module):
    """A user side (dynamic users shared by user_id and friends; fixed ages) and an item side
    (dynamic items), scored by a dot product of small towers."""

    def __init__(self, policies: str) -> None:
        super().__init__()
        users, items = POLICIES[policies]
        self.users = EmbeddingTables(
            [Table("user", ROWS["users.user"], 8, dynamic=users), Table("age", 7, 8)],
            [
                Feature("user_id", "user"),
                Feature("friends", "user", hotness=4, jagged=True, pooling="mean"),
                Feature("age", "age"),
            ],
        )
        self.items = EmbeddingTables(
            [Table("item", ROWS["items.item"], 8, dynamic=items)], [Feature("item_id", "item")]
        )
        self.user_tower = nn.Sequential(nn.Linear(3 * 8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, dense: torch.Tensor, ids: KeyedIds) -> torch.Tensor:
        u, i = self.users(ids), self.items(ids)
        user = self.user_tower(torch.cat([u["user_id"], u["friends"], u["age"]], dim=1))
        return (user * i["item_id"]).sum(1) + self.bias + dense.sum(1)


def pool(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1 << 40, (n,), generator=torch.Generator().manual_seed(seed))


def batch(step: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A global batch at `step`: skewed draws from a window of each pool that drifts."""
    users, items = pool(POOLS["user"], 1), pool(POOLS["item"], 2)

    def draw(p: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        start = 25 * step  # the popular ids change as training goes on
        pick = (torch.rand(shape, generator=g) ** 2 * 150).long() + start
        return p[pick % p.numel()]

    friends = draw(users, (B, 4))
    length = torch.randint(0, 5, (B, 1), generator=g)
    friends[torch.arange(4).expand(B, 4) >= length] = -1
    ids = torch.cat(
        [
            draw(users, (B, 1)),
            friends,
            torch.randint(0, 7, (B, 1), generator=g),
            draw(items, (B, 1)),
        ],
        1,
    )
    return torch.randn(B, 2, generator=g), ids, (torch.rand(B, generator=g) < 0.4).float()


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [batch(s, g) for s in range(steps + 1)]  # the last one is scored in evaluation


def build(group, sharding: str, pins, sparse: str, policies: str):  # noqa: ANN001, ANN201
    """(the parallelized model, its dense optimizer)."""
    model = parallelized(lambda: TwoSided(policies), group, sharding, pins, sparse)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def run_steps(model, opt, group, steps: range) -> list[float]:  # noqa: ANN001
    """Train on global batches `steps` (this rank's slice of each); the global mean losses."""
    part, data = rank_slice(group), batches()
    return [
        step_mean_loss(model, opt, group, *(x[part] for x in data[step]), FEATURES)
        for step in steps
    ]


def collect(model, group, losses: list[float]) -> dict:  # noqa: ANN001
    """Scores of the batch after the last training one in evaluation (no admission), then
    this rank's metrics, shards (rows, optimizer state and map arrays) and maps."""
    names, hotness = zip(*FEATURES, strict=True)
    dense, ids, _ = batches()[STEPS]
    part = rank_slice(group)
    model.eval()
    with torch.no_grad():
        scores = model(dense[part], KeyedIds(ids[part], names, hotness))
    model.train()
    modules = embedding_modules(unwrap(model))
    shards = shard_copies(unwrap(model))
    metrics = EmbeddingCounters()
    for m in modules:
        metrics.add(m.take_metrics())
    return {
        "losses": losses,
        "scores": scores,
        "metrics": metrics,
        "shards": shards,
        "maps": [
            (
                d.table.name,
                d.b0 * d.S,
                d.col_start,
                d.slot_id.clone(),
                d.score.clone(),
                d.last.clone(),
                d.cand_ids.clone(),
                d.cand_counts.clone(),
                d.clock,
            )
            for m in modules
            for g in m.groups.values()
            for _, d in g.dynamic()
        ],  # fmt: skip
    }


def train(group, sharding: str, pins, sparse: str, policies: str) -> dict:  # noqa: ANN001
    """STEPS steps from the start, then collect."""
    model, opt = build(group, sharding, pins, sparse, policies)
    return collect(model, group, run_steps(model, opt, group, range(STEPS)))


def full_tables(results: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Every table's rows and optimizer state, reassembled from all ranks' shards (the map
    arrays: full_maps)."""
    return assemble_tables(results, ROWS, DIMS)


def full_maps(results: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Every dynamic table's per-slot map state over all its rows, candidates (sorted by id)
    and clocks, from all ranks' shards; column shards' copies must agree."""
    out: dict[str, dict] = {}
    seen: dict[tuple[str, int, str], torch.Tensor] = {}
    for res in results:
        for name, start, _col, slot_id, score, last, cand, counts, clock in res["maps"]:
            entry = out.setdefault(name, {"clocks": set(), "cand": {}})
            entry["clocks"].add(clock)
            for key, value in (("slot_id", slot_id), ("score", score), ("last", last)):
                if (name, start, key) in seen:  # another column shard: the same map
                    assert torch.equal(seen[name, start, key], value), f"{name}.{key}: columns"
                seen[name, start, key] = value
                buf = entry.setdefault(key, torch.full((ROWS[name],), -7, dtype=value.dtype))
                buf[start : start + value.numel()] = value
            for i, c in zip(cand.tolist(), counts.tolist(), strict=True):
                assert entry["cand"].setdefault(i, c) == c, f"{name}: candidate {i}"
    return out
