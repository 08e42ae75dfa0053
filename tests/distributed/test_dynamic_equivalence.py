"""Dynamic tables under hybridrec.parallelize at 1-4 ranks == one process running the same
policy: admitted ids, their slots, the policy's per-slot state, rows, optimizer state, losses
and evaluation scores.

The model and data (tests/distributed/dynamic_model.py): a user side (a dynamic user table
that a user id and a jagged, mean-pooled list of friends share, and a fixed age table) and an
item side (a dynamic item table). Ids are raw 40-bit values drawn with skew from pools far
larger than the tables' capacities, and the pools drift from step to step, so every step
admits and evicts. Each case trains six steps
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

from hybridrec.sparse.api import EmbeddingCounters
from tests.distributed.dynamic_model import POLICIES, STEPS, full_maps, full_tables, train
from tests.distributed.harness import run_shared

pytestmark = pytest.mark.slow

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


def run_cases(env, cases):
    return [train(env.group, *case) for case in cases]


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
        summed = EmbeddingCounters()
        for r in per_rank:
            summed.add(r["metrics"])
        for key in ("used", "capacity", "admitted_total", "evicted_total", "eval_unknown"):
            for table in ("users.user", "items.item"):
                got, want = summed.dynamic[table], ref["metrics"].dynamic[table]
                assert getattr(got, key) == getattr(want, key), f"{label} {table}.{key}"


def test_reference_evicts_and_admits():
    """The data exercises the policies: both tables fill up, evict, and leave ids unknown at
    evaluation (so the comparisons above are not of idle maps)."""
    for policies in POLICIES:
        m = reference("sgd", policies)["metrics"]
        for table in ("users.user", "items.item"):
            st = m.dynamic[table]
            assert st.evicted_total > 0, (policies, table)
            assert st.used > 0.8 * st.capacity
            assert st.eval_unknown > 0, (policies, table)
