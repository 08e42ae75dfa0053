"""One rank on the sharded path (sharding=host on one GPU, or any mode at W=1): when one
group holds every table whole, the collection looks up sample-major like the local one, with
no exchange, split, stack or cat. It must train bit for bit like the general sharded path it
replaces: same losses, rows, optimizer state, dense weights and cache counters, with host
caches that evict every step, with and without prefetching the next batch's rows."""

from __future__ import annotations

import pytest
import torch

from hybridrec.distributed import DistEnv
from hybridrec.sparse.exchange.sample_major import SampleMajor
from hybridrec.train.trainer import Trainer
from tests.distributed.harness import spawn, spawn_jobs
from tests.equivalence import HOST_STEPS, host_cfg, make_cfg, snapshot

# the module's tests share one module-scoped fixture: one test worker runs them all, so it
# is built once (scripts/test.sh: pytest-xdist --dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed/test_one_rank")]


def _train(env: DistEnv, mode: str, sparse: str, pooling: str, fast: bool, prefetch: bool):
    cfg = host_cfg(mode, sparse, 1)
    cfg.model.pooling = pooling
    trainer = Trainer(cfg, env)
    emb = trainer.embeddings[0]
    assert isinstance(emb.exchange, SampleMajor)  # this plan qualifies
    if not fast:
        emb.exchange = (
            emb.all_to_all
        )  # the general path: input dist, per-unit numbering, output dist
    batches = [trainer.train_batch(s) for s in range(HOST_STEPS)]
    losses = trainer.train_batches(batches, look_ahead=prefetch)
    stats = emb.cache_stats()
    counters = None
    if stats is not None:
        counters = (stats.hits, stats.rows_requested, stats.rows_loaded, stats.rows_written)
    return {"losses": torch.stack(losses), "counters": counters, **snapshot(trainer)}


def _both(env: DistEnv, mode: str, sparse: str, pooling: str, prefetch: bool) -> dict:
    torch.set_num_threads(1)
    return {fast: _train(env, mode, sparse, pooling, fast, prefetch) for fast in (True, False)}


CASES = [
    ("host", "rowwise_adagrad", "sum", True),
    ("host", "adam", "mean", False),
    ("table_wise", "sgd", "mean", False),
]


@pytest.fixture(scope="module")
def one_rank() -> dict:
    """Every case's result and the one-rank layouts, all in one 1-rank spawn."""
    jobs = [("/".join(map(str, case)), _both, case) for case in CASES]
    return spawn_jobs(1, [*jobs, ("layouts", _layouts, ())])


@pytest.mark.parametrize(("mode", "sparse", "pooling", "prefetch"), CASES)
def test_one_rank_layout_trains_like_the_general_path(one_rank, mode, sparse, pooling, prefetch):
    [res] = one_rank["/".join(map(str, (mode, sparse, pooling, prefetch)))]
    fast, general = res[True], res[False]
    assert torch.equal(fast["losses"], general["losses"])
    assert fast["counters"] == general["counters"]
    if mode == "host":
        assert fast["counters"][3] > 0  # the caches evicted (wrote rows back)
    for (spec, w, st), (_, w2, st2) in zip(fast["shards"], general["shards"], strict=True):
        assert torch.equal(w, w2), spec
        for k in st:
            assert torch.equal(st[k], st2[k]), (spec, k)
    for k, v in fast["dense"].items():
        assert torch.equal(v, general["dense"][k]), k


def _layouts(env: DistEnv) -> dict:

    out = {}
    for mode in ("table_wise", "data_parallel", "auto"):
        emb = Trainer(make_cfg(mode, "sgd", env.world_size), env).embeddings[0]
        out[mode] = isinstance(emb.exchange, SampleMajor)
    return out


def test_only_plans_with_one_whole_group_take_it(one_rank):
    [one] = one_rank["layouts"]
    # auto replicates nothing on one rank (a replica is the whole table there)
    assert one == {"table_wise": True, "data_parallel": False, "auto": True}
    two = spawn(2, _layouts)
    assert all(not any(r.values()) for r in two)
