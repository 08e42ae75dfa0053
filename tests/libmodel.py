"""A user's own model written with the library API (docs/library.md), the one the library suites
train: two EmbeddingTables, a user side (a user table that a user id and a jagged list of
friends share, mean-pooled, and an age table) and an item side (item ids, a genre list) of
another width, scored by a dot product of two small towers plus a dense input; its batches;
`train`, its own training loop at any world size; `full_tables`, every table reassembled from
the ranks' shards. Its building blocks (`parallelized`, `rank_slice`, `step_mean_loss`,
`shard_copies`, `assemble_tables`) serve the dynamic-table model too
(tests/distributed/dynamic_model.py). A plain module, so that test modules never import each
other."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import hybridrec
from hybridrec import EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.optim import RowWiseAdagrad, SparseAdagrad, SparseAdam, SparseSGD
from hybridrec.planner import CachePolicy
from hybridrec.sparse.api import embedding_modules

B, STEPS = 24, 4


FEATURES = [("user_id", 1), ("friends", 4), ("age", 1), ("item_id", 1), ("genres", 3)]


ROWS = {"users.user": 300, "users.age": 7, "items.item": 2000, "items.genre": 20}


OPTIMIZERS = {
    "sgd": lambda: SparseSGD(0.5),
    "rowwise_adagrad": lambda: RowWiseAdagrad(0.1),
    "adam": lambda: SparseAdam(0.01),
    "adagrad": lambda: SparseAdagrad(0.1),
}


class TwoSided(nn.Module):
    """A user model: a user side and an item side, each with its own EmbeddingTables."""

    def __init__(self) -> None:
        super().__init__()
        self.users = EmbeddingTables(
            [Table("user", ROWS["users.user"], 8), Table("age", ROWS["users.age"], 8)],
            [
                Feature("user_id", "user"),
                Feature("friends", "user", hotness=4, jagged=True, pooling="mean"),
                Feature("age", "age"),
            ],
        )
        self.items = EmbeddingTables(
            [Table("item", ROWS["items.item"], 4), Table("genre", ROWS["items.genre"], 4)],
            [Feature("item_id", "item"), Feature("genres", "genre", hotness=3, jagged=True)],
        )
        self.user_tower = nn.Sequential(nn.Linear(3 * 8 + 2, 16), nn.ReLU(), nn.Linear(16, 8))
        self.item_tower = nn.Linear(2 * 4, 8)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, dense: torch.Tensor, ids: KeyedIds) -> torch.Tensor:
        u, i = self.users(ids), self.items(ids)
        user = self.user_tower(torch.cat([u["user_id"], u["friends"], u["age"], dense], dim=1))
        item = self.item_tower(torch.cat([i["item_id"], i["genres"]], dim=1))
        return (user * item).sum(1) + self.bias


def batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """STEPS global batches (dense [B, 2], ids [B, 10] with -1 padding, labels [B])."""
    g = torch.Generator().manual_seed(3)
    rows = [ROWS["users.user"]] * 2 + [ROWS["users.age"], ROWS["items.item"], ROWS["items.genre"]]
    out = []
    for _ in range(STEPS):
        cols = []
        for (_, h), n in zip(FEATURES, rows, strict=True):
            ids = (torch.rand(B, h, generator=g) ** 2 * n).long()  # skewed: repeated rows
            if h > 1:  # a list: 0..h ids, the rest padding
                length = torch.randint(0, h + 1, (B, 1), generator=g)
                ids[torch.arange(h).expand(B, h) >= length] = -1
            cols.append(ids)
        labels = (torch.rand(B, generator=g) < 0.4).float()
        out.append((torch.randn(B, 2, generator=g), torch.cat(cols, 1), labels))
    return out


def parallelized(make: Callable[[], nn.Module], group, sharding: str, pins, sparse: str):  # noqa: ANN001, ANN201
    """The model `make()` builds, through hybridrec.parallelize as the library suites train it
    (batch B, OPTIMIZERS[sparse], host caches of 5% of the rows, seed 11). torch is seeded
    first: the same dense initialisation on every rank and in the reference."""
    torch.manual_seed(0)
    return hybridrec.parallelize(
        make(),
        batch_size=B,
        sparse_optimizer=OPTIMIZERS[sparse](),
        group=group,
        sharding=sharding,
        pins=pins,
        cache=CachePolicy(fraction=0.05),
        seed=11,
    )


def rank_slice(group) -> slice:  # noqa: ANN001
    """This rank's samples of a global batch of B (ranks hold equal slices in rank order)."""
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    return slice(rank * B // world, (rank + 1) * B // world)


def shard_copies(model: nn.Module) -> list:
    """Copies of this rank's shards, (spec, weight, optimizer state), after writing host
    caches' rows back into host memory; `model` unwrapped."""
    modules = embedding_modules(model)
    for m in modules:
        for g in m.host_groups():
            g.flush()
    return [
        (spec, w.clone(), {k: v.clone() for k, v in st.items()})
        for m in modules
        for spec, w, st in m.shard_views()
    ]


def train(group, sharding: str, pins, sparse: str) -> dict:  # noqa: ANN001
    model = parallelized(TwoSided, group, sharding, pins, sparse)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    part = rank_slice(group)
    losses = [
        step_mean_loss(model, opt, group, dense[part], ids[part], labels[part], FEATURES)
        for dense, ids, labels in batches()
    ]
    inner = unwrap(model)
    return {
        "losses": losses,
        "shards": shard_copies(inner),
        "dense": {k: v.detach().clone() for k, v in inner.named_parameters()},
    }


def full_tables(results: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Every table's rows and state, reassembled from all ranks' shards."""
    dims = {t: 8 if t.startswith("users.") else 4 for t in ROWS}
    return assemble_tables(results, ROWS, dims)


def step_mean_loss(model, opt, group, dense, ids, labels, features) -> float:  # noqa: ANN001
    """One training step on this rank's slice of a batch (dense [b, n], ids [b, H], labels
    [b]; `features`: (name, hotness) pairs); the global batch's mean loss."""
    names, hotness = zip(*features, strict=True)
    out = model(dense, KeyedIds(ids, names, hotness))
    loss = nn.functional.binary_cross_entropy_with_logits(out, labels)
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    if group is None:
        return float(total)
    dist.all_reduce(total, group=group)
    return float(total) / dist.get_world_size(group)


def unwrap(model) -> nn.Module:  # noqa: ANN001
    """The model inside DDP (parallelize wraps it when it has dense parameters)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def assemble_tables(
    results: list[dict], rows: dict[str, int], dims: dict[str, int]
) -> dict[str, dict[str, torch.Tensor]]:
    """Every table's rows and optimizer state [rows, dim] (or [rows]), reassembled from all
    ranks' shards (results' "shards": (spec, weight, state)); NaN where no shard wrote.
    Dynamic maps' arrays (state "dyn_*") are left out."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for res in results:
        for spec, w, state in res["shards"]:
            n, dim = rows[spec.table], dims[spec.table]
            entry = out.setdefault(spec.table, {})
            for name, t in {"weight": w, **state}.items():
                if name.startswith("dyn_"):
                    continue
                if t.dim() == 1:
                    buf = entry.setdefault(name, torch.full((n,), float("nan")))
                    buf[spec.row_start : spec.row_end] = t
                else:
                    buf = entry.setdefault(name, torch.full((n, dim), float("nan")))
                    buf[spec.row_start : spec.row_end, spec.col_start : spec.col_end] = t
    return out


@functools.cache
def one_process(sparse: str) -> dict:
    torch.set_num_threads(1)
    return train(None, "none", None, sparse)
