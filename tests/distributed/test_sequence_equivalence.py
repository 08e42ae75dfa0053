"""Sequence features (Pooling.NONE: a row per position, not pooled) under
hybridrec.parallelize at 1-4 ranks == one process: per-step losses, every row and its
optimizer state, and dense weights.

The model and data (tests/distributed/sequence_model.py): a history of items read position by
position, sharing the item table with the target item; a user table; a jagged mean-pooled list
of tags. Every sharding mode carries the history's rows through the all-to-all (table-wise,
column-wise, row-wise: a row per id comes back to its position), replicated tables look it up
locally, host memory behind a device cache, pins that split the tables differently, and a
dynamic item table (raw ids mapped on their shard's owner). Every sparse optimizer.
Tolerances as tests/distributed/test_equivalence.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.harness import run_shared
from tests.distributed.sequence_model import full_tables, train

pytestmark = pytest.mark.slow

CASES = [  # (sharding, pins, sparse optimizer, dynamic item table)
    ("table_wise", None, "sgd", False),
    ("row_wise", None, "adam", False),
    ("column_wise", None, "rowwise_adagrad", False),
    ("data_parallel", None, "adagrad", False),
    ("auto", None, "adam", False),
    ("host", None, "rowwise_adagrad", False),
    ("table_wise", {"items.item": "row_wise", "users.user": "column_wise"}, "adagrad", False),
    ("row_wise", None, "adagrad", True),
    ("column_wise", None, "sgd", True),
    ("host", None, "adam", True),
]


def run_cases(env, cases):  # noqa: ANN001, ANN201
    return [train(env.group, *case) for case in cases]


@functools.cache
def reference(sparse: str, dynamic: bool) -> dict:
    torch.set_num_threads(1)
    return train(None, "none", None, sparse, dynamic)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sequence_features_match_one_process(world):
    results = run_shared(world, run_cases, CASES)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    for k, (sharding, pins, sparse, dynamic) in enumerate(CASES):
        label = f"W={world} {sharding} {pins or ''} {sparse}{' dynamic' if dynamic else ''}"
        ref = reference(sparse, dynamic)
        per_rank = [r[k] for r in results]
        torch.testing.assert_close(
            torch.tensor(per_rank[0]["losses"]),
            torch.tensor(ref["losses"]),
            **tol,
            msg=lambda m, c=label: f"{c} losses: {m}",
        )
        got, want = full_tables(per_rank), full_tables([ref])
        for table, entries in want.items():
            for name, value in entries.items():
                assert not got[table][name].isnan().any(), f"{label} {table}.{name}: gaps"
                torch.testing.assert_close(
                    got[table][name], value, **tol,
                    msg=lambda m, t=table, n=name, c=label: f"{c} {t}.{n}: {m}",
                )  # fmt: skip
        for r in per_rank:
            for name, value in ref["dense"].items():
                torch.testing.assert_close(
                    r["dense"][name], value, **tol, msg=lambda m, c=label, n=name: f"{c} {n}: {m}"
                )


def test_the_reference_trains_every_position():
    """The data exercises the feature: positions past a history's end and gaps are -1, the
    rest are rows (so the comparison above is not of an idle table), and training moves
    them."""
    from tests.distributed.sequence_model import B, L, batches

    _, ids, _ = batches(False)[0]
    history = ids[:, :L]
    assert 0 < int((history < 0).sum()) < B * L
    first = reference("sgd", False)
    assert first["losses"][0] != first["losses"][-1]
