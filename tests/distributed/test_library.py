"""hybridrec.parallelize on a user's own model == the same model on one process, at 1-4 ranks.

The model is written as a user would (docs/library.md): plain PyTorch around two
EmbeddingTables, a user side (a user table that a user id and a jagged list of friends share,
mean-pooled, and an age table) and an item side (item ids, a genre list) of another width,
scored by a dot product of two small towers plus a dense input. It trains through its own
loop (no Trainer, no Hydra) on the same global batches at 1, 2, 3 and 4 ranks in every
sharding mode, each collection pinned differently in one case, with every sparse optimizer;
per-step global losses, every table's rows and optimizer state, and every dense weight equal
the single-process run's (float32 round-off, as tests/distributed/test_equivalence.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hybridrec
from hybridrec import EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.optim import RowWiseAdagrad, SparseAdagrad, SparseAdam, SparseSGD
from hybridrec.planner import CachePolicy
from hybridrec.sparse.api import embedding_modules
from tests.distributed.harness import run_shared

pytestmark = pytest.mark.slow

B, STEPS = 24, 4
FEATURES = [("user_id", 1), ("friends", 4), ("age", 1), ("item_id", 1), ("genres", 3)]
ROWS = {"users.user": 300, "users.age": 7, "items.item": 2000, "items.genre": 20}
OPTIMIZERS = {
    "sgd": lambda: SparseSGD(0.5),
    "rowwise_adagrad": lambda: RowWiseAdagrad(0.1),
    "adam": lambda: SparseAdam(0.01),
    "adagrad": lambda: SparseAdagrad(0.1),
}
CASES = [  # (sharding, pins, sparse optimizer)
    ("table_wise", None, "adam"),
    ("column_wise", None, "rowwise_adagrad"),
    ("row_wise", None, "adagrad"),
    ("data_parallel", None, "sgd"),
    ("auto", None, "rowwise_adagrad"),
    ("host", None, "adam"),
    # the two collections sharded differently: users by rows, items by columns
    ("table_wise", {"users.user": "row_wise", "items.item": "column_wise"}, "adagrad"),
]


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


def train(group, sharding: str, pins, sparse: str) -> dict:
    torch.manual_seed(0)  # the same dense initialisation on every rank and in the reference
    model = hybridrec.parallelize(
        TwoSided(),
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
    losses = []
    for dense, ids, labels in batches():
        part = slice(rank * B // world, (rank + 1) * B // world)
        out = model(dense[part], KeyedIds(ids[part], names, hotness))
        loss = nn.functional.binary_cross_entropy_with_logits(out, labels[part])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        losses.append(float(total) / world)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    for m in embedding_modules(inner):
        for g in m.host_groups():
            g.flush()  # host tables: cached rows back into host memory
    return {
        "losses": losses,
        "shards": [
            (spec, w.clone(), {k: v.clone() for k, v in st.items()})
            for m in embedding_modules(inner)
            for spec, w, st in m.shard_views()
        ],
        "dense": {k: v.detach().clone() for k, v in inner.named_parameters()},
    }


def run_cases(env, cases):
    return {"cases": [train(env.group, *case) for case in cases], "uneven": uneven(env.group)}


def uneven(group) -> dict:
    """A global batch of 23 split unevenly over the ranks (the last partial batch of an
    epoch): evaluation under no_grad scores each rank's samples as one process would; a
    training step on such a split is refused on every rank."""
    torch.manual_seed(0)
    model = hybridrec.parallelize(
        TwoSided(), batch_size=B, sparse_optimizer=SparseSGD(0.1), group=group,
        sharding="row_wise", seed=11,
    )  # fmt: skip
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    dense, ids, labels = batches()[0]
    cuts = [round(23 * r / world) for r in range(world + 1)]  # e.g. 12 / 11
    part = slice(cuts[rank], cuts[rank + 1])
    keyed = KeyedIds(ids[part], *zip(*FEATURES, strict=True))
    with torch.no_grad():
        scores = model(dense[part], keyed)
    refused = None
    if world > 1:
        try:
            model(dense[part], keyed).sum().backward()
        except ValueError as e:
            refused = str(e)
    return {"scores": scores, "refused": refused}


def full_tables(results: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Every table's rows and state, reassembled from all ranks' shards."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for res in results:
        for spec, w, state in res["shards"]:
            dim = 8 if spec.table.startswith("users.") else 4
            entry = out.setdefault(spec.table, {})
            for name, t in {"weight": w, **state}.items():
                if t.dim() == 1:
                    buf = entry.setdefault(name, torch.full((ROWS[spec.table],), float("nan")))
                    buf[spec.row_start : spec.row_end] = t
                else:
                    buf = entry.setdefault(name, torch.full((ROWS[spec.table], dim), float("nan")))
                    buf[spec.row_start : spec.row_end, spec.col_start : spec.col_end] = t
    return out


@functools.cache
def reference(sparse: str) -> dict:
    torch.set_num_threads(1)
    return train(None, "none", None, sparse)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_user_model_matches_one_process(world):
    results = run_shared(world, run_cases, CASES)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    want = uneven(None)["scores"]
    torch.testing.assert_close(torch.cat([r["uneven"]["scores"] for r in results]), want, **tol)
    for r in results if world > 1 else []:
        assert "the ranks' batches differ in size in training" in r["uneven"]["refused"]
    for k, (sharding, pins, sparse) in enumerate(CASES):
        label = f"W={world} {sharding} {pins or ''} {sparse}"
        ref = reference(sparse)
        per_rank = [r["cases"][k] for r in results]
        torch.testing.assert_close(
            torch.tensor(per_rank[0]["losses"]), torch.tensor(ref["losses"]), **tol
        )
        got, want = full_tables(per_rank), full_tables([ref])
        assert set(got) == set(ROWS), label
        for table, entries in want.items():
            for name, value in entries.items():
                assert not got[table][name].isnan().any(), f"{label} {table}.{name}: gaps"
                torch.testing.assert_close(
                    got[table][name],
                    value,
                    **tol,
                    msg=lambda m, t=table, n=name, c=label: f"{c} {t}.{n}: {m}",
                )
        for name, value in ref["dense"].items():
            for r in per_rank:
                torch.testing.assert_close(r["dense"][name], value, **tol)


def test_declarations_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="at least one Table"):
        EmbeddingTables([])
    with pytest.raises(ValueError, match="looks up table 'usr', which is not declared"):
        EmbeddingTables([Table("user", 10, 4)], [Feature("user_id", "usr")])
    with pytest.raises(ValueError, match="no feature looks up table"):
        EmbeddingTables([Table("a", 10, 4), Table("b", 10, 4)], [Feature("x", "a")])
    with pytest.raises(RuntimeError, match="call hybridrec.parallelize"):
        TwoSided()(torch.zeros(2, 2), torch.zeros(2, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="declares no EmbeddingTables"):
        hybridrec.parallelize(nn.Linear(2, 2), batch_size=4, sparse_optimizer=None)
    model = hybridrec.parallelize(
        TwoSided(), batch_size=4, sparse_optimizer=SparseSGD(0.1), sharding="none"
    )
    with pytest.raises(ValueError, match=r"no feature\(s\) \['genres'\]"):
        model(
            torch.zeros(2, 2),
            KeyedIds(
                torch.zeros(2, 7, dtype=torch.long),
                ["user_id", "friends", "age", "item_id"],
                [1, 4, 1, 1],
            ),
        )


def test_deferred_bad_ids_are_raised_by_check_inputs():
    """As on CUDA (the id check deferred, no host sync per step): the step runs, and
    hybridrec.check_inputs names the feature, the id and the sample."""
    model = hybridrec.parallelize(
        TwoSided(), batch_size=4, sparse_optimizer=SparseSGD(0.1), sharding="none"
    )
    for m in embedding_modules(model):
        m.checker.defer = True
    ids = torch.zeros(4, 10, dtype=torch.long)
    ids[2, 7] = 25  # genres: a table of 20 rows
    names, hotness = zip(*FEATURES, strict=True)
    model(torch.zeros(4, 2), KeyedIds(ids, names, hotness)).sum().backward()
    with pytest.raises(ValueError, match=r"genres.*id 25 at sample 2"):
        hybridrec.check_inputs(model)
