"""Jagged bags, mean pooling, mixed widths and a shared table, sharded on W gloo ranks == one
process.

A DCNv2 model over 6 features and 5 tables (3 to 20,000 rows; widths 4 and 8; four features
are lists holding 0..k ids per sample, padded with -1, empty bags included; sum and mean
pooling; a single id and a list look up one table, as a user id and the user's follows)
trains on the same global batches at 1, 2, 3 and 4 ranks in every sharding mode, each
sparse optimizer at least twice across the modes, and with host-resident tables behind
device caches that evict (prefetching the next batch's rows, as training does). Compared
with the single-process run like tests/distributed/test_equivalence.py: first logits,
per-step losses, every row and its optimizer state, every dense weight; same tolerance.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hybridrec.config import Config
from hybridrec.distributed import DistEnv, init_distributed
from tests.distributed.harness import run_shared
from tests.equivalence import collect, compare, jagged_cfg, train_and_collect

pytestmark = pytest.mark.slow

HOST_STEPS = 24  # jagged bags carry half the ids: the caches need more steps to evict
CASES = [  # (sharding, sparse optimizer, arch): every mode, every optimizer
    ("table_wise", "adam", "dcnv2"),
    ("column_wise", "rowwise_adagrad", "dcnv2"),
    ("row_wise", "sgd", "dcnv2"),
    ("row_wise", "adam", "dcnv2"),
    ("data_parallel", "rowwise_adagrad", "dcnv2"),
    ("auto", "sgd", "dcnv2"),
    ("host", "adam", "dcnv2"),
    # one width (DLRM): the reference runs the one-group sample-major lookup instead
    ("row_wise", "rowwise_adagrad", "dlrm"),
]


def run_all(env: DistEnv, configs: list[tuple[str, Config]]) -> dict:
    return {
        name: collect(env, cfg, prefetch=True, steps=HOST_STEPS)
        if name.startswith("host")
        else train_and_collect(env, cfg)
        for name, cfg in configs
    }


@functools.cache
def _reference(sparse: str, host: bool, arch: str) -> dict:
    """The single-process run (sharding=none) of a case (deterministic: run once per session,
    shared by the world sizes)."""
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    cfg = jagged_cfg("none", sparse, 1, host, arch)
    if host:
        return collect(env, cfg, prefetch=False, steps=HOST_STEPS)
    return train_and_collect(env, cfg)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_jagged_mixed_width_model_matches_reference(world):
    configs = [(f"{m}/{o}/{a}", jagged_cfg(m, o, world, m == "host", a)) for m, o, a in CASES]
    results = run_shared(world, run_all, configs)
    for name, cfg in configs:
        mode, sparse, arch = name.split("/")
        ref = _reference(sparse, mode == "host", arch)
        per_rank = [res[name] for res in results]
        if mode == "host":
            stats = [r["stats"] for r in per_rank if r["stats"] is not None]
            assert sum(s.rows_written for s in stats) > 0, f"{name}: the caches never evicted"
        compare(ref, per_rank, cfg, f"W={world} {name}")
