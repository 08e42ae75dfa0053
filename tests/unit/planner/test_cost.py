"""The cost model and the plan table: bytes worked out by hand from the exchange protocol
described in docs/planner.md. B = 8, W = 2, B_l = 4 unless a test says otherwise."""

from __future__ import annotations

import pytest

from hybridrec.planner import (
    OptimizerFootprint,
    Topology,
    estimate_cost,
    format_plan,
    plan_sharding,
    rank_memory,
)
from hybridrec.sparse.costs import id_wire_bytes
from hybridrec.types import ShardingPlan, ShardSpec, TableConfig, TablePlan
from tests.unit.planner.cases import GIB, hand_plan, kaggle


def test_cost_bytes_table_column_and_data_parallel():
    plan, tables = hand_plan()
    cost = estimate_cost(plan, tables, Topology(2, GIB), 8)
    r0, r1 = cost.ranks
    # ids (int32 on the wire): a (rank 0) gets 4*2*4 = 32 from rank 1; b slices swap
    # 4*1*4 = 16 each way; c is replicated: each rank looks up its own samples, no ids move.
    # Every chunk also carries its sender's bad-id flag, 4 bytes.
    assert (r0.ids_sent_bytes, r0.ids_recv_bytes) == (16 + 4, 32 + 16 + 4)
    assert (r1.ids_sent_bytes, r1.ids_recv_bytes) == (32 + 16 + 4, 16 + 4)
    # pooled outputs: 4 samples x width 4 x 4 bytes = 64 per shard to the other rank
    assert (r0.emb_sent_bytes, r0.emb_recv_bytes) == (128, 64)
    assert (r1.emb_sent_bytes, r1.emb_recv_bytes) == (64, 128)
    # c's gradients: a ring all-reduce of 3 rows x (4 + 1) x 4 bytes; 2 (W-1)/W = 1 for W=2
    assert r0.dp_grad_sent_bytes == r0.dp_grad_recv_bytes == 3 * 5 * 4
    # rows gathered: a 8*2, b 8, c 4*3 (each rank looks up its own 4 samples for DP tables)
    assert (r0.lookups_per_step, r1.lookups_per_step) == (16 + 8 + 12, 8 + 12)
    # memory: weights (a 160, b 96, c 48) and buffers B*h*8 + 2*B*w*4
    assert r0.weight_bytes == 160 + 96 + 48 and r1.weight_bytes == 96 + 48
    # ... plus the replicated table's gradient all-reduce buffer, 3 rows x (4 + 1) x 4 bytes
    assert r0.buffer_bytes == (128 + 256) + (64 + 256) + (192 + 256) + 3 * 5 * 4
    assert r0.optimizer_bytes == 0 and r0.total_bytes == r0.weight_bytes + r0.buffer_bytes
    assert r0.num_shards == 3 and r1.num_shards == 2
    assert cost.table_bytes == 160 + 192 + 48
    # seconds: bytes / bandwidth, one node
    assert r0.input_dist_s == pytest.approx(52 / 300e9)
    assert r0.lookup_s == pytest.approx((16 * 4 + 8 * 4 + 12 * 4) * 4 / 2.98e12)
    assert r0.total_s == pytest.approx(
        r0.input_dist_s + r0.lookup_s + r0.output_dist_s + r0.backward_s
    )
    assert cost.step_s == max(r0.total_s, r1.total_s)


def test_cost_optimizer_state_matches_the_footprint():
    plan, tables = hand_plan()
    adagrad = OptimizerFootprint.for_optimizer("rowwise_adagrad")
    r0 = estimate_cost(plan, tables, Topology(2, GIB), 8, adagrad).ranks[0]
    assert r0.optimizer_bytes == (10 + 6 + 3) * 4
    adam = OptimizerFootprint.for_optimizer("adam")
    r0 = estimate_cost(plan, tables, Topology(2, GIB), 8, adam).ranks[0]
    assert r0.optimizer_bytes == (10 * 4 + 6 * 4 + 3 * 4) * 8


def test_cost_row_wise_uses_the_expected_share_and_one_count_exchange():
    tables = [TableConfig("r", 10, 4, hotness=2)]
    topo = Topology(2, GIB)
    plan = plan_sharding(tables, topo, "row_wise", 8)
    r0, r1 = estimate_cost(plan, tables, topo, 8).ranks
    # each shard holds half the rows: 4 lengths + 4*2*0.5 ids, 4 bytes each (int32), the
    # bad-id flag (4), plus 1 count (int64)
    assert r0.ids_sent_bytes == r0.ids_recv_bytes == 16 + 16 + 4 + 8
    # compact partial sums: of 4 bags, those with one of their 2 ids in the half, 1 - 0.5^2
    assert r0.emb_sent_bytes == r0.emb_recv_bytes == 4 * 0.75 * 4 * 4
    assert r0.lookups_per_step == r1.lookups_per_step == 8


def test_cost_row_wise_one_id_per_bag_returns_what_table_wise_does():
    """One id per sample over W row shards: each shard returns 1/W of the bags, so row-wise
    moves as many pooled bytes as table-wise (the dense partial sums moved W times more)."""
    tables = [TableConfig("r", 4000, 16, hotness=1)]
    topo = Topology(4, GIB)
    rw = estimate_cost(plan_sharding(tables, topo, "row_wise", 8), tables, topo, 4096).ranks
    tw = estimate_cost(plan_sharding(tables, topo, "table_wise", 8), tables, topo, 4096).ranks
    assert sum(r.emb_sent_bytes for r in rw) == pytest.approx(sum(r.emb_sent_bytes for r in tw))


def test_cost_splits_traffic_between_nodes():
    tables = [TableConfig("a", 100, 8)]
    topo = Topology(4, GIB, ranks_per_node=2, intra_node_bw=100.0, inter_node_bw=10.0)
    plan = ShardingPlan(4, (TablePlan("a", "table_wise", (ShardSpec("a", 0, 0, 100, 0, 8),)),))
    ranks = estimate_cost(plan, tables, topo, 16).ranks
    # B_l * hotness * 4 (int32) and the bad-id flag from every other rank to rank 0; every
    # rank also sends its flag (4 bytes) to the others
    ids, flag = 4 * 4 + 4, 4
    assert ranks[0].ids_recv_bytes == 3 * ids
    assert ranks[0].input_dist_s == pytest.approx(max(ids / 100.0, 2 * ids / 10.0))
    # rank 1, same node as rank 0: its ids there, flags to the other node's two ranks
    assert ranks[1].input_dist_s == pytest.approx(max(ids / 100.0, 2 * flag / 10.0))
    assert ranks[2].input_dist_s == pytest.approx((ids + flag) / 10.0)  # other node


def test_ids_cross_as_int64_only_for_tables_past_int32():
    small, huge = TableConfig("s", 2**31 - 1, 8), TableConfig("h", 2**31, 8)
    assert id_wire_bytes([small]) == 4 and id_wire_bytes([small, huge]) == 8
    topo = Topology(2, 1 << 50)
    for tables, per_id in (([small], 4), ([small, huge], 8)):
        specs = [(ShardSpec(t.name, 1, 0, t.num_rows, 0, 8),) for t in tables]
        plan = ShardingPlan(
            2, tuple(TablePlan(t.name, "table_wise", s) for t, s in zip(tables, specs))
        )
        r0 = estimate_cost(plan, tables, topo, 8).ranks[0]
        # B_l = 4 ids per table to rank 1, and the bad-id flag
        assert r0.ids_sent_bytes == (len(tables) * 4 + 1) * per_id


def test_cost_memory_matches_the_planner_budget_check():
    tables = kaggle()
    topo = Topology(4, 75 * GIB)
    plan = plan_sharding(tables, topo, "auto", 65536)
    cost = estimate_cost(plan, tables, topo, 65536)
    assert [r.total_bytes for r in cost.ranks] == [
        m.total for m in rank_memory(plan, tables, 65536, OptimizerFootprint(), 4)
    ]
    assert cost.peak_bytes <= topo.hbm_bytes_per_rank


def test_format_plan_lists_tables_ranks_and_a_summary():
    plan, tables = hand_plan()
    cost = estimate_cost(plan, tables, Topology(2, GIB), 8)
    text = format_plan(plan, cost, tables)
    assert "0:all" in text and "0:cols[0:4] 1:cols[4:8]" in text and "0-1:all" in text
    lines = text.splitlines()
    assert any(line.split()[:2] == ["0", "3"] for line in lines)  # rank 0 holds 3 shards
    assert lines[-1].startswith("400 B of tables over 2 ranks, peak rank")
