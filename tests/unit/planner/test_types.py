"""The planner's value types."""

from __future__ import annotations

import pytest

from hybridrec.planner import (
    OPTIMIZERS,
    CachePolicy,
    MemoryUse,
    OptimizerFootprint,
    Topology,
    human_bytes,
)
from hybridrec.planner.types import GIB, NO_OPTIMIZER_STATE, OPTIMIZER_FOOTPRINTS
from hybridrec.types import SPARSE_OPTIMIZER_STATE, StateKind


def test_cache_policy_rejects_bad_values():
    with pytest.raises(ValueError, match="fraction must be in"):
        CachePolicy(0.0)
    with pytest.raises(ValueError, match="GB must be > 0"):
        CachePolicy(gb=-1)


def test_cache_policy_rows_keep_two_batches_and_at_most_the_shard():
    policy = CachePolicy(0.01, min_batches=2)
    assert policy.rows(1_000_000, 64) == 10_000  # 1% of the rows
    assert policy.rows(1000, 64) == 128  # 1% is 10 rows, below two batches of 64 ids
    assert policy.rows(100, 64) == 100  # never more than the shard
    assert policy.rows(1_000_000, 64, fraction=0.5) == 500_000  # a fraction chosen by cache_gb


def test_optimizers_are_the_keys_of_the_footprint_table():
    names = ("sgd", "rowwise_adagrad", "adam", "adagrad")
    assert OPTIMIZERS == tuple(OPTIMIZER_FOOTPRINTS) == names
    for name in OPTIMIZERS:
        assert OptimizerFootprint.for_optimizer(name) == OPTIMIZER_FOOTPRINTS[name]
    assert OptimizerFootprint.for_optimizer("sgd") == NO_OPTIMIZER_STATE
    assert OptimizerFootprint.for_optimizer("rowwise_adagrad").bytes_for(10, 4) == 10 * 4
    assert OptimizerFootprint.for_optimizer("adam").bytes_for(10, 4) == 10 * 4 * 8
    assert OptimizerFootprint.for_optimizer("adagrad").bytes_for(10, 4) == 10 * 4 * 4


def test_footprints_follow_from_the_state_kinds():
    """Every sparse optimizer the types declare is sized, from its state's kinds alone: 4
    bytes per row-wise state, 4 per element of each element-wise one."""
    assert OPTIMIZERS == tuple(SPARSE_OPTIMIZER_STATE)
    for name, state in SPARSE_OPTIMIZER_STATE.items():
        assert OptimizerFootprint.for_optimizer(name) == OptimizerFootprint.of_state(state.values())
    row, element = StateKind.ROW, StateKind.ELEMENT
    assert OptimizerFootprint.of_state([]) == NO_OPTIMIZER_STATE
    assert OptimizerFootprint.of_state([row, element, element, "row"]) == OptimizerFootprint(8, 8)
    with pytest.raises(ValueError, match="'column' is not a valid StateKind"):
        OptimizerFootprint.of_state(["column"])


def test_memory_use_adds_by_kind_and_topology_groups_ranks_into_nodes():
    assert MemoryUse(1, 2, 3) + MemoryUse(10, 20, 30) == MemoryUse(11, 22, 33)
    assert MemoryUse(1, 2, 3).total == 6
    topo = Topology(16, GIB, ranks_per_node=8)
    assert [topo.node_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]


def test_human_bytes_uses_binary_units():
    assert human_bytes(0) == "0 B" and human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(3 * GIB) == "3.0 GiB"
    assert human_bytes(2048 << 40) == "2048.0 TiB"  # the largest unit
