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

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hybridrec
from hybridrec import EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.optim import SparseSGD
from hybridrec.sparse.api import embedding_modules
from tests.distributed.harness import run_shared
from tests.libmodel import FEATURES, ROWS, B, TwoSided, batches, full_tables, one_process, train

pytestmark = pytest.mark.slow

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
        ref = one_process(sparse)
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
