"""The planner's cost model against the bytes the exchanges actually move (gloo, 3 ranks).

For table-wise, column-wise and data-parallel plans every byte is known in advance, so the
per-rank figures must match exactly: ids sent/received in the input dist (plus the DP id
all-gather), pooled embeddings in the output dist, the mirrored gradients in backward and
the DP gradient all-gather. For row-wise plans the ids a rank sends and the pooled rows it
gets back depend on the data (a shard returns only the bags with an id in it; the model uses
a uniform expectation): the output dist must equal what the batch's ids imply, counted here
independently, and the count exchange is exact.
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.builder import build
from hybridrec.distributed.comm import CommStats
from hybridrec.model import bce_loss
from hybridrec.planner import OptimizerFootprint, Topology, estimate_cost
from tests.distributed.harness import spawn, spawn_jobs
from tests.equivalence import jagged_cfg, make_cfg

# the module's tests share one module-scoped fixture: one test worker runs them all, so it
# is built once (scripts/test.sh: pytest-xdist --dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed/test_exchange_bytes")]
MODES = ["table_wise", "column_wise", "row_wise", "data_parallel", "auto"]
BF16_MODES = ["table_wise", "row_wise"]  # compared with MODES' fp32 steps of the same modes
JAGGED_MODES = ["table_wise", "column_wise"]


def one_step(env, modes, comm_dtype="fp32"):
    from hybridrec.data import build_source

    out = {}
    for mode in modes:
        cfg = make_cfg(mode, "sgd", env.world_size)
        cfg.sharding.comm_dtype = comm_dtype
        batch = build_source(cfg).batch(0, cfg.train.batch_size)
        out[mode] = measure_step(env, cfg, batch, comm_bytes=4 if comm_dtype == "fp32" else 2)
    return out


def measure_step(env, cfg, batch, comm_bytes=4):
    """One forward/backward of this rank's part of `batch`: (bytes sent and received per
    exchange, this rank's cost-model figures, the plan)."""
    stats = CommStats()
    model, plan = build(cfg, env, stats)
    n = batch.size // env.world_size
    part = batch.slice(env.rank * n, (env.rank + 1) * n)
    bce_loss(model(part.dense, part.ids), part.labels).backward()
    cost = estimate_cost(
        plan,
        cfg.model.tables(),
        Topology(env.world_size, 1 << 40),
        cfg.train.batch_size,
        OptimizerFootprint.for_optimizer("sgd"),
        comm_bytes=comm_bytes,
    )
    exact = output_bytes(batch, plan, cfg.model.tables(), env.rank, comm_bytes)
    return dict(stats.sent), dict(stats.recv), cost.ranks[env.rank], plan, exact


def output_bytes(batch, plan, tables, rank, comm_bytes):
    """(sent, received) output-dist bytes of `rank`, from the batch's ids: a table-wise or
    column-wise shard returns B_l rows to every other rank, a row-wise one the rows of the
    samples with an id in its range (one table per feature, as in make_cfg's models)."""
    world = plan.world_size
    b_local = batch.size // world
    offsets = [0]
    for t in tables:
        offsets.append(offsets[-1] + t.hotness)
    sent = recv = 0
    for f, tp in enumerate(plan.tables):
        if tp.sharding.value == "data_parallel":
            continue
        cols = batch.ids[:, offsets[f] : offsets[f + 1]]
        for s in tp.shards:
            for p in range(world):
                if p == s.rank or rank not in (p, s.rank):
                    continue
                mine = cols[p * b_local : (p + 1) * b_local]
                if tp.sharding.value == "row_wise":
                    inside = (mine >= s.row_start) & (mine < s.row_end)
                    rows = int(inside.any(1).sum())
                else:
                    rows = b_local
                nbytes = rows * s.width * comm_bytes
                if rank == s.rank:
                    sent += nbytes
                else:
                    recv += nbytes
    return sent, recv


@pytest.fixture(scope="module")
def three() -> dict:
    """Per-rank byte counts of the fp32 and bf16 steps and the jagged ones: one 3-rank spawn."""
    jobs = [
        ("fp32", one_step, (MODES,)),
        ("bf16", one_step, (BF16_MODES, "bf16")),
        ("jagged", jagged_step, (JAGGED_MODES,)),
    ]
    return spawn_jobs(3, jobs)


def test_bytes_exchanged_equal_cost_model(three):
    results = three["fp32"]
    for mode in MODES:
        for rank, res in enumerate(results):
            sent, recv, cost, plan, (emb_sent, emb_recv) = res[mode]
            row_wise = any(tp.sharding.value == "row_wise" for tp in plan.tables)
            label = f"{mode} rank {rank}"
            # forward output dist and its mirrored backward: what the ids imply, and without
            # row-wise tables exactly the cost model's
            assert sent.get("output_dist", 0) == emb_sent, label
            assert recv.get("output_dist", 0) == emb_recv, label
            assert sent.get("output_dist.backward", 0) == emb_recv, label
            assert recv.get("output_dist.backward", 0) == emb_sent, label
            if not row_wise:
                assert (emb_sent, emb_recv) == (cost.emb_sent_bytes, cost.emb_recv_bytes), label
            else:  # the model's uniform expectation, near this (seeded) batch's figures
                assert emb_sent == pytest.approx(cost.emb_sent_bytes, rel=0.25), label
                assert emb_recv == pytest.approx(cost.emb_recv_bytes, rel=0.25), label
            # replicated tables: a dense all-reduce is exact; a sparse all-gather of touched
            # rows is bounded by the model's figure (it assumes every id hits a new row)
            dp_sent, dp_recv = sent.get("dp_grads", 0), recv.get("dp_grads", 0)
            if mode == "data_parallel":  # the 20,000-row table makes the gather cheaper
                assert 0 < dp_sent <= cost.dp_grad_sent_bytes, label
                assert 0 < dp_recv <= cost.dp_grad_recv_bytes, label
            else:
                assert dp_sent == pytest.approx(cost.dp_grad_sent_bytes), label
                assert dp_recv == pytest.approx(cost.dp_grad_recv_bytes), label
            ids_sent = sent.get("input_dist", 0) + sent.get("input_dist.counts", 0)
            ids_recv = recv.get("input_dist", 0) + recv.get("input_dist.counts", 0)
            if not row_wise:
                assert ids_sent == cost.ids_sent_bytes, label
                assert ids_recv == cost.ids_recv_bytes, label
            else:
                assert sent.get("input_dist.counts") == 8 * (3 - 1), label
        if mode == "row_wise":  # every id goes to exactly one shard: totals add up
            total_sent = sum(r[mode][0]["input_dist"] for r in results)
            total_recv = sum(r[mode][1]["input_dist"] for r in results)
            assert total_sent == total_recv > 0


def test_bf16_comms_halve_the_output_dist_and_the_cost_model_knows(three):
    fp32, bf16 = three["fp32"], three["bf16"]  # fp32: the same steps (one model per mode)
    for mode in BF16_MODES:
        for rank in range(3):
            sent32, *_ = fp32[rank][mode]
            sent16, recv16, cost, _, (emb_sent, emb_recv) = bf16[rank][mode]
            assert sent16["output_dist"] * 2 == sent32["output_dist"] > 0
            assert sent16["output_dist.backward"] * 2 == sent32["output_dist.backward"]
            assert (sent16["output_dist"], recv16["output_dist"]) == (emb_sent, emb_recv)
            if mode != "row_wise":
                assert (emb_sent, emb_recv) == (cost.emb_sent_bytes, cost.emb_recv_bytes)


def _one_rank(env):
    from torch.nn.parallel import DistributedDataParallel

    from hybridrec.distributed.comm import all_to_all

    cfg = make_cfg("table_wise", "sgd", 1)
    model, _ = build(cfg, env)
    x = torch.arange(6.0)
    return isinstance(model, DistributedDataParallel), all_to_all(x, [6], [6], env.group) is x


def test_one_rank_runs_the_sharded_path_without_ddp_or_copies():
    """sharding=host on one GPU runs the sharded path on a one-rank group: its exchanges are
    identities (no copy) and the dense part is not wrapped in DDP (nothing to average)."""
    [(ddp, same)] = spawn(1, _one_rank)
    assert not ddp and same


def jagged_step(env, modes):
    from hybridrec.data import build_source

    out = {}
    for mode in modes:
        cfg = jagged_cfg(mode, "sgd", env.world_size)
        cfg.train.batch_size = 1536
        batch = build_source(cfg).batch(0, cfg.train.batch_size)
        # the planner's expectation, from this very batch: each table's mean ids per bag
        offsets = [0]
        for t in cfg.model.tables():
            offsets.append(offsets[-1] + t.hotness)
        cols = [batch.ids[:, a:b] for a, b in zip(offsets, offsets[1:])]
        cfg.model.mean_ids = [float((c >= 0).sum(1).double().mean()) for c in cols]
        out[mode] = measure_step(env, cfg, batch)
    return out


def test_jagged_bytes_follow_the_cost_model(three):
    """Jagged tables send their real ids plus one count per sample: the output dist and the
    size exchange are exact; the ids, data-dependent, match the model's expectation (the
    batch's mean ids per bag) within 5% per rank (without the counts they would be ~30% off)."""
    results = three["jagged"]
    for mode in JAGGED_MODES:
        for rank, res in enumerate(results):
            sent, recv, cost, *_ = res[mode]
            label = f"jagged {mode} rank {rank}"
            assert sent["output_dist"] == cost.emb_sent_bytes, label
            assert recv["output_dist"] == cost.emb_recv_bytes, label
            assert sent["input_dist.counts"] == 8 * (3 - 1), label
            ids_sent = sent["input_dist"] + sent["input_dist.counts"]
            ids_recv = recv["input_dist"] + recv["input_dist.counts"]
            assert ids_sent == pytest.approx(cost.ids_sent_bytes, rel=0.05), label
            assert ids_recv == pytest.approx(cost.ids_recv_bytes, rel=0.05), label
