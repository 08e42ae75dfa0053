"""Dynamic tables under hybridrec.parallelize at 1-4 ranks == one process running the same
policy: admitted ids, their slots, the policy's per-slot state, rows, optimizer state, losses
and evaluation scores.

The model has a user side (a dynamic user table that a user id and a jagged, mean-pooled
list of friends share, and a fixed age table) and an item side (a dynamic item table). Ids
are raw 40-bit values drawn with skew from pools far larger than the tables' capacities, and
the pools drift from step to step, so every step admits and evicts. Each case trains six steps
through its own loop in one sharding mode (row-wise ranges own whole hash buckets; table-wise,
column-wise, auto, host memory behind a device cache, and the tables pinned differently), with
one sparse optimizer each and a policy set (LFU with count admission and an unknown row; LRU
and TTL with probability admission; zeros for unknown ids), then scores a batch of unseen and
seen ids in evaluation (no admission). Tolerances as tests/distributed/test_equivalence.py;
maps compare exactly.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hybridrec
from hybridrec import Dynamic, EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.optim import RowWiseAdagrad, SparseAdagrad, SparseAdam, SparseSGD
from hybridrec.planner import CachePolicy
from hybridrec.sparse.api import embedding_modules
from tests.distributed.harness import run_shared

pytestmark = pytest.mark.slow

B, STEPS = 24, 6
FEATURES = [("user_id", 1), ("friends", 4), ("age", 1), ("item_id", 1)]
ROWS = {"users.user": 64, "users.age": 7, "items.item": 48}
DIMS = {"users.user": 8, "users.age": 8, "items.item": 8}
POOLS = {"user": 400, "item": 300}  # distinct raw ids per side (tables hold 56-64)
OPTIMIZERS = {
    "sgd": lambda: SparseSGD(0.5),
    "rowwise_adagrad": lambda: RowWiseAdagrad(0.1),
    "adam": lambda: SparseAdam(0.01),
    "adagrad": lambda: SparseAdagrad(0.1),
}
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
CASES = [  # (sharding, pins, sparse optimizer, policies)
    ("row_wise", None, "adagrad", "lfu"),
    ("row_wise", None, "adam", "ttl"),
    ("table_wise", None, "sgd", "lfu"),
    ("column_wise", None, "rowwise_adagrad", "lfu"),
    ("table_wise", {"users.user": "row_wise", "items.item": "column_wise"}, "adam", "lfu"),
    ("auto", None, "rowwise_adagrad", "ttl"),
    ("host", None, "adagrad", "lfu"),
    ("row_wise", None, "sgd", "ttl"),
]


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


def batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [batch(s, g) for s in range(STEPS + 1)]  # the last one is scored in evaluation


def train(group, sharding: str, pins, sparse: str, policies: str) -> dict:
    torch.manual_seed(0)
    model = hybridrec.parallelize(
        TwoSided(policies),
        batch_size=B,
        sparse_optimizer=OPTIMIZERS[sparse](),
        group=group,
        sharding=sharding,
        pins=pins,
        cache=CachePolicy(fraction=0.05),
        seed=11,
    )
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names, hotness = zip(*FEATURES, strict=True)
    part = slice(rank * B // world, (rank + 1) * B // world)
    losses = []
    *train_batches, last = batches()
    for dense, ids, labels in train_batches:
        out = model(dense[part], KeyedIds(ids[part], names, hotness))
        loss = nn.functional.binary_cross_entropy_with_logits(out, labels[part])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        losses.append(float(total) / world)
    model.eval()
    with torch.no_grad():
        scores = model(last[0][part], KeyedIds(last[1][part], names, hotness))
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    modules = embedding_modules(inner)
    for m in modules:
        for g in m.host_groups():
            g.flush()
    metrics = {}
    for m in modules:
        metrics.update(m.take_metrics())
    return {
        "losses": losses,
        "scores": scores,
        "metrics": metrics,
        "shards": [
            (spec, w.clone(), {k: v.clone() for k, v in st.items()})
            for m in modules
            for spec, w, st in m.shard_views()
        ],
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
            for d in m.dynamic.values()
        ],  # fmt: skip
    }


def run_cases(env, cases):
    return [train(env.group, *case) for case in cases]


def full_tables(results: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Every table's rows and state, reassembled from all ranks' shards."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for res in results:
        for spec, w, state in res["shards"]:
            rows, dim = ROWS[spec.table], DIMS[spec.table]
            entry = out.setdefault(spec.table, {})
            for name, t in {"weight": w, **state}.items():
                if t.dim() == 1:
                    buf = entry.setdefault(name, torch.full((rows,), float("nan")))
                    buf[spec.row_start : spec.row_end] = t
                else:
                    buf = entry.setdefault(name, torch.full((rows, dim), float("nan")))
                    buf[spec.row_start : spec.row_end, spec.col_start : spec.col_end] = t
    return out


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


@functools.cache
def reference(sparse: str, policies: str) -> dict:
    torch.set_num_threads(1)
    return train(None, "none", None, sparse, policies)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dynamic_tables_match_one_process(world):
    results = run_shared(world, run_cases, CASES)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    for k, (sharding, pins, sparse, policies) in enumerate(CASES):
        label = f"W={world} {sharding} {pins or ''} {sparse} {policies}"
        ref = reference(sparse, policies)
        per_rank = [r[k] for r in results]
        torch.testing.assert_close(
            torch.tensor(per_rank[0]["losses"]), torch.tensor(ref["losses"]), **tol
        )
        scores = torch.cat([r["scores"] for r in per_rank])
        torch.testing.assert_close(scores, ref["scores"], **tol, msg=lambda m, c=label: f"{c}: {m}")
        got_maps, want_maps = full_maps(per_rank), full_maps([ref])
        for table, want in want_maps.items():
            got = got_maps[table]
            assert got["clocks"] == want["clocks"] == {STEPS}, label
            assert got["cand"] == want["cand"], f"{label} {table}: candidates"
            for key in ("slot_id", "score", "last"):
                assert torch.equal(got[key], want[key]), f"{label} {table}.{key}"
        got, want = full_tables(per_rank), full_tables([ref])
        for table, entries in want.items():
            for name, value in entries.items():
                assert not got[table][name].isnan().any(), f"{label} {table}.{name}: gaps"
                torch.testing.assert_close(
                    got[table][name],
                    value,
                    **tol,
                    msg=lambda m, t=table, n=name, c=label: f"{c} {t}.{n}: {m}",
                )
        summed = {}
        for r in per_rank:
            for key, v in r["metrics"].items():
                summed[key] = summed.get(key, 0.0) + v
        for key in ("used", "capacity", "admitted_total", "evicted_total", "eval_unknown"):
            for table in ("users.user", "items.item"):
                name = f"dynamic.{table}.{key}"
                assert summed[name] == ref["metrics"][name], f"{label} {name}"


def test_reference_evicts_and_admits():
    """The data exercises the policies: both tables fill up, evict, and leave ids unknown at
    evaluation (so the comparisons above are not of idle maps)."""
    for policies in POLICIES:
        m = reference("sgd", policies)["metrics"]
        for table in ("users.user", "items.item"):
            assert m[f"dynamic.{table}.evicted_total"] > 0, (policies, table)
            assert m[f"dynamic.{table}.used"] > 0.8 * m[f"dynamic.{table}.capacity"]
            assert m[f"dynamic.{table}.eval_unknown"] > 0, (policies, table)
