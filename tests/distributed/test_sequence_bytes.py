"""A sequence feature's exchange bytes against the planner's cost model (gloo, 3 ranks).

A sequence (Pooling.NONE) sends a count per sample and its ids, and a row per id comes back
(not one pooled row per sample). With every position filled, a table-wise or column-wise
plan's bytes are known in advance and must equal the cost model's exactly; a row-wise shard
returns a row per id in its range, counted here from the batch's ids.
"""

from __future__ import annotations

import pytest
import torch

import hybridrec
from hybridrec import EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.distributed.comm import CommStats
from hybridrec.model.tables import declared_features
from hybridrec.optim import SparseSGD
from hybridrec.planner import OptimizerFootprint, Topology, estimate_cost
from tests.distributed.harness import run_shared

pytestmark = pytest.mark.slow
B, L, ROWS, DIM = 24, 5, 90, 6
MODES = ["table_wise", "column_wise", "row_wise"]


def _model() -> EmbeddingTables:
    return EmbeddingTables(
        [Table("item", ROWS, DIM)],
        [Feature("history", "item", hotness=L, pooling="none"), Feature("target", "item")],
        namespace="",
    )


def _ids() -> torch.Tensor:
    return torch.randint(0, ROWS, (B, L + 1), generator=torch.Generator().manual_seed(4))


def _measure(env, modes):  # noqa: ANN001, ANN202
    out = {}
    ids = _ids()
    n = B // env.world_size
    part = ids[env.rank * n : (env.rank + 1) * n]
    for mode in modes:
        stats = CommStats()
        model = hybridrec.parallelize(
            _model(), batch_size=B, sparse_optimizer=SparseSGD(0.1), group=env.group,
            sharding=mode, stats=stats,
        )  # fmt: skip
        out_t = model(KeyedIds(part, ["history", "target"], [L, 1]))
        out_t["history"].sum().backward()
        cost = estimate_cost(
            model.plan, declared_features(model), Topology(env.world_size, 1 << 40), B,
            OptimizerFootprint.for_optimizer("sgd"),
        )  # fmt: skip
        out[mode] = (dict(stats.sent), dict(stats.recv), cost.ranks[env.rank], model.plan)
    return out


def _row_wise_bytes(plan, rank: int, world: int) -> tuple[int, int]:  # noqa: ANN001
    """(sent, received) output-dist bytes of `rank`: a row per id in each shard's range (the
    history's L ids, the target's one pooled row per sample with an id there)."""
    ids, b_local = _ids(), B // world
    sent = recv = 0
    [tp] = plan.tables
    for s in tp.shards:
        for p in range(world):
            if p == s.rank or rank not in (p, s.rank):
                continue
            mine = ids[p * b_local : (p + 1) * b_local]
            inside = (mine >= s.row_start) & (mine < s.row_end)
            rows = int(inside[:, :L].sum()) + int(inside[:, L:].any(1).sum())
            nbytes = rows * s.width * 4
            sent, recv = (sent + nbytes, recv) if rank == s.rank else (sent, recv + nbytes)
    return sent, recv


def test_a_sequence_sends_a_row_per_id_as_the_cost_model_says():
    results = run_shared(3, _measure, MODES)
    for mode in MODES:
        for rank, res in enumerate(results):
            sent, recv, cost, plan = res[mode]
            label = f"{mode} rank {rank}"
            got = (sent.get("output_dist", 0), recv.get("output_dist", 0))
            assert got == (recv.get("output_dist.backward", 0), sent.get("output_dist.backward", 0))
            if mode == "row_wise":
                assert got == _row_wise_bytes(plan, rank, 3), label
                assert got[0] == pytest.approx(cost.emb_sent_bytes, rel=0.3), label
            else:  # a row per id of the history (all L present) and one per target
                assert got == (cost.emb_sent_bytes, cost.emb_recv_bytes), label
                ids = [sum(d.get(k, 0) for k in ("input_dist", "input_dist.counts"))
                       for d in (sent, recv)]  # fmt: skip
                assert ids == [cost.ids_sent_bytes, cost.ids_recv_bytes], label
