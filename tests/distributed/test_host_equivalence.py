"""Host-resident tables behind tiny device caches == the single-process reference.

sharding=host on 1, 2 and 3 gloo ranks (each rank owns a row range of every table, in host
memory, with its own cache) and sharding=auto with a budget that pushes the big tables to
host memory, for every sparse optimizer, with and without prefetching the next batch's rows
(the trainer's order: prefetch between a step's forward and its backward). The caches hold
two batches' ids (the planner's floor, with cache_fraction=0.001) and the ids are spread
(Zipf 0.3), so within the 10 steps the caches fill and evict, writing rows back (asserted). Compared like test_equivalence: logits, losses,
every row and its optimizer state, dense weights; the cache itself adds no round-off (it only
moves rows), so the tolerance is the sharded path's.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hybridrec.config import Config
from hybridrec.distributed import DistEnv, init_distributed
from hybridrec.sparse.host import HostCachedEmbedding
from tests.distributed.harness import run_shared
from tests.equivalence import (
    OPTIMIZERS,
    ZIPF,
    collect,
    compare,
    host_cfg,
    make_cfg,
)

pytestmark = pytest.mark.slow


def run_all(env: DistEnv, configs: list[tuple[str, Config, bool, bool]]) -> dict:
    out = {}
    for name, cfg, prefetch, warm in configs:
        # the prefetch's admission on the groups' threads, as on CUDA (the CPU default: not)
        HostCachedEmbedding.background = True if "background" in name else None
        try:
            out[name] = collect(env, cfg, prefetch, warm)
        finally:
            HostCachedEmbedding.background = None
    return out


@functools.cache
def _reference(sparse: str) -> dict:
    """The single-process run (sharding=none) on the same HOST_STEPS batches (deterministic: run
    once per session, shared by the world sizes)."""
    torch.set_num_threads(1)
    cfg = make_cfg("none", sparse, 1)
    cfg.data.zipf_exponent = ZIPF
    return collect(init_distributed("cpu"), cfg, prefetch=False)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_host_tables_match_reference(world):
    configs = []
    for sparse in OPTIMIZERS:
        configs.append((f"host/{sparse}", host_cfg("host", sparse, world), False, False))
        configs.append((f"host/{sparse}/prefetch", host_cfg("host", sparse, world), True, False))
    background = host_cfg("host", "adam", world)
    configs.append(("host/adam/prefetch/background admission", background, True, False))
    warm = host_cfg("host", "rowwise_adagrad", world)
    configs.append(("host/rowwise_adagrad/prefetch/warm start", warm, True, True))
    auto = host_cfg("auto", "rowwise_adagrad", world)
    configs.append(("auto/rowwise_adagrad/prefetch", auto, True, False))
    results = run_shared(world, run_all, configs)
    refs = {sparse: _reference(sparse) for sparse in OPTIMIZERS}
    for name, cfg, prefetch, _ in configs:
        mode, sparse = name.split("/")[:2]
        per_rank = [res[name] for res in results]
        # with prefetch, training lookups take the slots (and sort) the prefetch made
        assert (sum(r["prefetched"] for r in per_rank) > 0) == prefetch, name
        plan = per_rank[0]["plan"]
        on_host = {tp.table for tp in plan.tables if any(s.on_host for s in tp.shards)}
        if mode == "host":
            assert on_host == {t.name for t in cfg.model.tables()}
        else:
            assert on_host == {"cat_3", "cat_4"}, plan
        stats = [r["stats"] for r in per_rank if r["stats"] is not None]
        assert sum(s.rows_written for s in stats) > 0, f"{name}: the caches never evicted"
        compare(refs[sparse], per_rank, cfg, f"W={world} {name}")
