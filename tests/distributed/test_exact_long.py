"""Exact mode over hundreds of steps: 2, 3 and 4 gloo ranks give one process's bits at every
step (issue 40: "after many steps, hundreds on small models").

Round-off that a changed summation order leaves at one step grows over the following ones
(the default path's runs at 1 and 2 ranks part from step ~200), so a short run could miss an
order that depends on the world size only rarely, e.g. on which rank a row's ids land. Here
the dynamic-table model (tests/distributed/dynamic_model.py: raw ids drifting through
admitting and evicting maps, a jagged mean-pooled feature sharing a table) trains STEPS = 200
steps of a global batch of 24 in M = 12 micro-shards (which 1, 2, 3 and 4 divide), its tables
split by rows (each bag's ids from several ranks) with Adagrad at 2, 3 and 4 ranks, its
reference `sharding=none` in one process: every step's loss, and at the end every row,
optimizer-state entry, dynamic map array and dense weight, torch.equal. (Host tables behind
evicting caches cost half as much again per step: test_exact runs them for 100 steps on 2
ranks.) Also: `exact_all_reduce` gives the tree's bits by both of its ways (one all-gather,
or all-to-all then all-gather) at every world size.

The runs reuse test_exact's process groups (tests/distributed/harness.py run_shared) and its
library loop (tests/distributed/exact_helpers.py): measured beside test_exact, whose groups
it shares, 49 s with other jobs keeping the 2 cores' load at 8; about a third of that idle.
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.distributed import DistEnv, init_distributed
from hybridrec.distributed.exact_sum import exact_all_reduce, tree_sum
from tests.distributed import dynamic_model
from tests.distributed.exact_helpers import (
    assert_same_dense,
    assert_same_maps,
    assert_same_tables,
    train_library,
)
from tests.distributed.harness import run_shared

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed/test_exact")]

M, STEPS = 12, 200
CASE = ("row_wise", None, "adagrad", "lfu")  # dynamic tables split by rows, Adagrad's state
WORLDS = (2, 3, 4)


def all_reduce_ways(env: DistEnv) -> dict[str, torch.Tensor]:
    """exact_all_reduce of M micro-shards' partials [M, P] (M/W of them on this rank) by its
    one-all-gather way and by its all-to-all way, and the tree over all of them here."""
    g = torch.Generator().manual_seed(7)
    parts = torch.randn(M, 1001, generator=g) * torch.logspace(-6, 6, 1001)  # round-off shows
    m_local = M // env.world_size
    mine = parts[env.rank * m_local : (env.rank + 1) * m_local]
    return {
        "gather": exact_all_reduce(mine, env.group),
        "all_to_all": exact_all_reduce(mine, env.group, gather_below=0),
        "tree": tree_sum(list(parts)),
        "reversed": tree_sum(list(parts.flip(0))),  # another order: other bits somewhere
    }


def jobs(env: DistEnv, case: tuple) -> dict:
    return {"long": train_library(env, case, STEPS, M), "sums": all_reduce_ways(env)}


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    """Per world size (1: the reference, `sharding=none` in this process) the per-rank
    results."""
    torch.set_num_threads(1)
    reference = ("none", None, *CASE[2:])
    out = {1: [jobs(init_distributed("cpu"), reference)]}
    for world in WORLDS:
        out[world] = run_shared(world, jobs, CASE, timeout=600)
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_hundreds_of_steps_stay_one_process_bit_for_bit(runs, world):
    ref, per_rank, label = runs[1][0]["long"], [r["long"] for r in runs[world]], f"W={world}"
    assert ref["losses"].shape == (STEPS,)
    for r, res in enumerate(per_rank):
        same = res["losses"] == ref["losses"]
        first = int((~same).nonzero()[0]) if not same.all() else None
        assert first is None, f"{label}: rank {r}'s loss differs first at step {first + 1}"
    rows = (dynamic_model.ROWS, dynamic_model.DIMS)
    assert_same_tables(rows, ref, per_rank, label)
    assert_same_dense(ref, per_rank, label)
    assert_same_maps(ref, per_rank, label)


@pytest.mark.parametrize("world", WORLDS)
def test_exact_all_reduce_is_the_tree_by_either_way(runs, world):
    for r, res in enumerate(runs[world]):
        sums = res["sums"]
        assert not torch.equal(sums["reversed"], sums["tree"]), "the data cannot tell orders"
        for way in ("gather", "all_to_all"):
            assert torch.equal(sums[way], sums["tree"]), f"W={world} rank {r}: {way}"
