"""The sharding planner: valid plans in every mode, budgets, determinism, errors, cost model, CLI.

A valid plan covers every table's rows x columns exactly once (data-parallel tables: one full
replica per rank), never puts two column slices of one table on one rank, and keeps every
rank's memory under the budget. The cost-model numbers below are worked out by hand from the
exchange protocol described in hybridrec/planner/cost.py.
"""

from __future__ import annotations

import itertools
import pickle

import pytest

from hybridrec.planner import (
    MODES,
    CachePolicy,
    OptimizerFootprint,
    PlannerError,
    Topology,
    column_widths,
    estimate_cost,
    format_plan,
    host_memory,
    plan_sharding,
    rank_memory,
    row_ranges,
)
from hybridrec.planner.cli import _load_tables, main
from hybridrec.planner.planner import BALANCE_TOLERANCE, CACHE_META_BYTES, id_wire_bytes
from hybridrec.types import ShardingPlan, ShardingType, ShardSpec, TableConfig, TablePlan

GIB = 1 << 30
MIB = 1 << 20
SGD = OptimizerFootprint()

TINY = [
    TableConfig("t0", 5000, 16),
    TableConfig("t1", 1200, 16, hotness=2),
    TableConfig("t2", 400, 16),
    TableConfig("t3", 100, 16, hotness=3),
    TableConfig("t4", 20, 16),
    TableConfig("t5", 4, 16),
]
# five tables of very different sizes (3 rows to 2M rows), for uneven world sizes
UNEVEN = [
    TableConfig("huge", 2_000_000, 64),
    TableConfig("big", 300_000, 64, hotness=4),
    TableConfig("mid", 20_000, 64),
    TableConfig("small", 700, 64, hotness=2),
    TableConfig("tiny", 3, 64),
]


def kaggle() -> list[TableConfig]:
    return _load_tables("dlrm_kaggle")[1]


def check_plan(
    plan: ShardingPlan,
    tables: list[TableConfig],
    budget: int,
    batch: int,
    optimizer: OptimizerFootprint = SGD,
    weight_bytes: int = 4,
) -> None:
    """Coverage, distinct ranks for column slices, and the budget on every rank."""
    assert [tp.table for tp in plan.tables] == [t.name for t in tables]
    for tp, t in zip(plan.tables, tables, strict=True):
        assert tp.reason
        for s in tp.shards:
            assert s.table == t.name and 0 <= s.rank < plan.world_size
            assert 0 <= s.row_start < s.row_end <= t.num_rows
            assert 0 <= s.col_start < s.col_end <= t.dim
        if tp.sharding is ShardingType.DATA_PARALLEL:
            assert [s.rank for s in tp.shards] == list(range(plan.world_size))
            assert all((s.num_rows, s.width) == (t.num_rows, t.dim) for s in tp.shards)
            continue
        assert sum(s.num_rows * s.width for s in tp.shards) == t.num_rows * t.dim
        for a, b in itertools.combinations(tp.shards, 2):
            rows_overlap = a.row_start < b.row_end and b.row_start < a.row_end
            cols_overlap = a.col_start < b.col_end and b.col_start < a.col_end
            assert not (rows_overlap and cols_overlap), (a, b)
        if tp.sharding is ShardingType.COLUMN_WISE:
            ranks = [s.rank for s in tp.shards]
            assert len(set(ranks)) == len(ranks), f"{t.name}: slices share a rank: {ranks}"
            cols = [(s.col_start, s.col_end) for s in tp.shards]
            assert cols == sorted(cols)
        if tp.sharding is ShardingType.TABLE_WISE:
            assert len(tp.shards) == 1
    needs = [m.total for m in rank_memory(plan, tables, batch, optimizer, weight_bytes)]
    assert max(needs) <= budget, needs


# --------------------------------------------------------------------------------------------
# Splitting helpers


def test_column_widths_prefer_multiples_of_four():
    assert column_widths(16, 3) == [8, 4, 4]
    assert column_widths(128, 3) == [44, 44, 40]
    assert column_widths(128, 8) == [16] * 8
    assert column_widths(10, 3) == [4, 3, 3]  # 10 is not a multiple of 4: plain even split
    assert column_widths(8, 4) == [2, 2, 2, 2]  # not enough columns for width-4 slices
    for dim, k in itertools.product([1, 3, 4, 16, 17, 128], [1, 2, 3, 5, 8]):
        if k <= dim:
            widths = column_widths(dim, k)
            assert sum(widths) == dim and len(widths) == k and max(widths) - min(widths) <= 4


def test_row_ranges_first_ranges_get_the_extra_rows():
    assert row_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert row_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


# --------------------------------------------------------------------------------------------
# Valid plans


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_mode_gives_a_valid_plan(mode, world):
    batch = 12 * world
    topo = Topology(world, hbm_bytes_per_rank=64 * MIB)
    plan = plan_sharding(TINY, topo, mode, batch, OptimizerFootprint.for_optimizer("adam"))
    check_plan(plan, TINY, topo.hbm_bytes_per_rank, batch, OptimizerFootprint(0, 8))
    assert plan.world_size == world
    if mode == "host":
        assert all(s.on_host for tp in plan.tables for s in tp.shards)
    elif mode != "auto":
        assert {tp.sharding for tp in plan.tables} == {ShardingType(mode)}
    if mode != "host":
        assert not any(s.on_host for tp in plan.tables for s in tp.shards)


def test_strict_modes_follow_their_rules():
    topo = Topology(3, 1 * GIB)
    cw = plan_sharding(TINY, topo, "column_wise", 30)
    assert [s.width for s in cw.table("t0").shards] == [8, 4, 4]
    rw = plan_sharding(TINY, topo, "row_wise", 30)
    assert [(s.rank, s.row_start, s.row_end) for s in rw.table("t2").shards] == [
        (0, 0, 134),
        (1, 134, 267),
        (2, 267, 400),
    ]
    assert len(rw.table("t5").shards) == 3  # 4 rows over 3 ranks
    dp = plan_sharding(TINY, topo, "data_parallel", 30)
    assert all(len(tp.shards) == 3 for tp in dp.tables)
    tw = plan_sharding(TINY, topo, "table_wise", 30)
    assert all(tp.reason.startswith("fits whole on rank") for tp in tw.tables)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [2, 3])
def test_uneven_tables_on_uneven_world_sizes(mode, world):
    batch = 6 * 1024
    topo = Topology(world, hbm_bytes_per_rank=2 * GIB)
    plan = plan_sharding(UNEVEN, topo, mode, batch)
    check_plan(plan, UNEVEN, topo.hbm_bytes_per_rank, batch)


def test_table_wise_balances_memory_and_lookups():
    # Equal memory; the hot ones must not pile up on one rank.
    tables = [TableConfig(f"t{i}", 1000, 16, hotness=20 if i < 2 else 1) for i in range(4)]
    plan = plan_sharding(tables, Topology(2, GIB), "table_wise", 64)
    hot_ranks = {plan.table("t0").shards[0].rank, plan.table("t1").shards[0].rank}
    assert hot_ranks == {0, 1}


def test_plans_are_deterministic():
    tables = kaggle()
    topo = Topology(4, 75 * GIB)
    for mode in MODES:
        a = plan_sharding(tables, topo, mode, 65536)
        b = plan_sharding(list(tables), topo, mode, 65536)
        assert a == b and a.fingerprint() == b.fingerprint()
    # the placement does not depend on the order the tables come in, only on their names
    a = plan_sharding(tables, topo, "auto", 65536)
    b = plan_sharding(tables[::-1], topo, "auto", 65536)
    assert {tp.table: tp.shards for tp in a.tables} == {tp.table: tp.shards for tp in b.tables}


# --------------------------------------------------------------------------------------------
# auto


def test_auto_replicates_tiny_tables_and_splits_a_table_too_big_for_one_rank():
    tables = [
        TableConfig("tiny", 100, 16),  # 6.4 KiB
        TableConfig("mid", 10_000, 16),
        TableConfig("large", 200_000, 64),  # 48.8 MiB of weights > 40 MiB budget
    ]
    topo = Topology(4, 40 * MIB)
    plan = plan_sharding(tables, topo, "auto", 64, data_parallel_max_bytes=64 << 10)
    check_plan(plan, tables, topo.hbm_bytes_per_rank, 64)
    assert plan.table("tiny").sharding is ShardingType.DATA_PARALLEL
    assert "replicated" in plan.table("tiny").reason
    assert plan.table("mid").sharding is ShardingType.TABLE_WISE
    large = plan.table("large")
    assert large.sharding is ShardingType.COLUMN_WISE and len(large.shards) >= 2
    assert all(s.width >= 4 and s.width % 4 == 0 for s in large.shards)
    assert "column shards" in large.reason


def test_auto_falls_back_to_row_wise_when_the_width_is_too_small():
    tables = [TableConfig("narrow", 4_000_000, 4)]  # 61 MiB, one column slice at most
    topo = Topology(4, 40 * MIB)
    plan = plan_sharding(tables, topo, "auto", 64)
    check_plan(plan, tables, topo.hbm_bytes_per_rank, 64)
    assert plan.table("narrow").sharding is ShardingType.ROW_WISE
    assert [s.rank for s in plan.table("narrow").shards] == [0, 1, 2, 3]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_auto_balances_kaggle(world):
    # Documented target: the fullest rank within BALANCE_TOLERANCE (10%) of the mean memory.
    # Lookups (rows x width gathered) stay within 25% of the mean.
    tables, batch = kaggle(), 65536 * 3
    topo = Topology(world, 75 * GIB)
    plan = plan_sharding(tables, topo, "auto", batch)
    check_plan(plan, tables, topo.hbm_bytes_per_rank, batch)
    cost = estimate_cost(plan, tables, topo, batch)
    mem = [r.total_bytes for r in cost.ranks]
    assert max(mem) <= (1 + BALANCE_TOLERANCE) * sum(mem) / world
    work = [r.lookup_s for r in cost.ranks]
    assert max(work) <= 1.25 * sum(work) / world
    # counting tables is not balancing: the big tables do not share ranks
    big = [tp for tp in plan.tables if tp.table in ("cat_2", "cat_11", "cat_20", "cat_15")]
    assert len({s.rank for tp in big for s in tp.shards}) == world


def test_auto_fits_nvidia_113b_example_on_8_ranks():
    """Criteo 1TB uncapped (largest table 292,775,614 x 128 fp32 = 150 GB) on 8 x 80 GB."""
    name, tables = _load_tables("dlrm_1tb_uncapped")
    assert max(t.num_rows for t in tables) == 292_775_614
    topo = Topology(8, 75 * GIB)  # 80 GiB minus 5 GiB for the dense model and activations
    plan = plan_sharding(tables, topo, "auto", 65536)
    check_plan(plan, tables, topo.hbm_bytes_per_rank, 65536)
    assert plan.table("cat_19").sharding is ShardingType.COLUMN_WISE
    # and with 80 GB counted in decimal bytes, no reserve
    plan = plan_sharding(tables, Topology(8, 80 * 10**9), "auto", 65536)
    check_plan(plan, tables, 80 * 10**9, 65536)


# --------------------------------------------------------------------------------------------
# Errors


def test_table_wise_error_names_the_table_and_every_rank():
    tables = [TableConfig("small", 10, 8), TableConfig("whale", 1_000_000, 64)]
    with pytest.raises(PlannerError) as info:
        plan_sharding(tables, Topology(3, 100 * MIB), "table_wise", 48)
    msg = str(info.value)
    assert "'whale'" in msg and "column_wise" in msg and "row_wise" in msg and "auto" in msg
    for r in range(3):
        assert f"rank {r}: needs" in msg
    assert "bytes)" in msg and "100.0 MiB (104,857,600 bytes)" in msg
    assert len(info.value.needs) == 3 and info.value.budget == 100 * MIB
    assert all(n > 100 * MIB for n in info.value.needs)
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == msg


@pytest.mark.parametrize("mode", ["column_wise", "row_wise", "data_parallel", "auto"])
def test_too_big_for_the_cluster_raises_with_per_rank_numbers(mode):
    tables = [TableConfig("whale", 4_000_000, 64), TableConfig("other", 3_000_000, 64)]
    with pytest.raises(PlannerError) as info:
        plan_sharding(tables, Topology(2, 256 * MIB), mode, 64)
    assert len(info.value.needs) == 2
    assert "rank 0: needs" in str(info.value) and "rank 1: needs" in str(info.value)
    assert max(info.value.needs) > 256 * MIB


def test_bad_arguments():
    topo = Topology(4, GIB)
    with pytest.raises(ValueError, match="allowed: table_wise, column_wise"):
        plan_sharding(TINY, topo, "diagonal", 64)
    with pytest.raises(ValueError, match="multiple of world_size 4"):
        plan_sharding(TINY, topo, "auto", 66)
    with pytest.raises(ValueError, match="duplicate"):
        plan_sharding([TINY[0], TINY[0]], topo, "auto", 64)
    with pytest.raises(ValueError, match="sgd, rowwise_adagrad, adam"):
        OptimizerFootprint.for_optimizer("lamb")
    with pytest.raises(ValueError, match="world_size"):
        Topology(0, GIB)
    assert OptimizerFootprint.for_optimizer("rowwise_adagrad") == OptimizerFootprint(4, 0)


# --------------------------------------------------------------------------------------------
# Cost model: hand-computed bytes. B = 8, W = 2, B_l = 4.


def hand_plan() -> tuple[ShardingPlan, list[TableConfig]]:
    tables = [
        TableConfig("a", 10, 4, hotness=2),  # table-wise on rank 0
        TableConfig("b", 6, 8),  # column-wise: cols [0:4] on rank 0, [4:8] on rank 1
        TableConfig("c", 3, 4, hotness=3),  # data-parallel
    ]
    plan = ShardingPlan(
        2,
        (
            TablePlan("a", ShardingType.TABLE_WISE, (ShardSpec("a", 0, 0, 10, 0, 4),)),
            TablePlan(
                "b",
                ShardingType.COLUMN_WISE,
                (ShardSpec("b", 0, 0, 6, 0, 4), ShardSpec("b", 1, 0, 6, 4, 8)),
            ),
            TablePlan(
                "c",
                ShardingType.DATA_PARALLEL,
                (ShardSpec("c", 0, 0, 3, 0, 4), ShardSpec("c", 1, 0, 3, 0, 4)),
            ),
        ),
    )
    return plan, tables


def test_cost_bytes_table_column_and_data_parallel():
    plan, tables = hand_plan()
    cost = estimate_cost(plan, tables, Topology(2, GIB), 8)
    r0, r1 = cost.ranks
    # ids (int32 on the wire): a (rank 0) gets 4*2*4 = 32 from rank 1; b slices swap
    # 4*1*4 = 16 each way; c is replicated: each rank looks up its own samples, no ids move.
    assert (r0.ids_sent_bytes, r0.ids_recv_bytes) == (16, 32 + 16)
    assert (r1.ids_sent_bytes, r1.ids_recv_bytes) == (32 + 16, 16)
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
    assert r0.input_dist_s == pytest.approx(48 / 300e9)
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
    # each shard holds half the rows: 4 lengths + 4*2*0.5 ids, 4 bytes each (int32), plus 1
    # count (int64)
    assert r0.ids_sent_bytes == r0.ids_recv_bytes == 16 + 16 + 8
    assert r0.emb_sent_bytes == r0.emb_recv_bytes == 4 * 4 * 4
    assert r0.lookups_per_step == r1.lookups_per_step == 8


def test_cost_splits_traffic_between_nodes():
    tables = [TableConfig("a", 100, 8)]
    topo = Topology(4, GIB, ranks_per_node=2, intra_node_bw=100.0, inter_node_bw=10.0)
    plan = ShardingPlan(4, (TablePlan("a", "table_wise", (ShardSpec("a", 0, 0, 100, 0, 8),)),))
    ranks = estimate_cost(plan, tables, topo, 16).ranks
    ids = 4 * 4  # B_l * hotness * 4 (int32) from every other rank to rank 0
    assert ranks[0].ids_recv_bytes == 3 * ids
    assert ranks[0].input_dist_s == pytest.approx(max(ids / 100.0, 2 * ids / 10.0))
    assert ranks[1].input_dist_s == pytest.approx(ids / 100.0)  # same node as rank 0
    assert ranks[2].input_dist_s == pytest.approx(ids / 10.0)  # other node


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
        assert r0.ids_sent_bytes == len(tables) * 4 * per_id  # B_l = 4 ids per table to rank 1


def test_cost_memory_matches_the_planner_budget_check():
    tables = kaggle()
    topo = Topology(4, 75 * GIB)
    plan = plan_sharding(tables, topo, "auto", 65536)
    cost = estimate_cost(plan, tables, topo, 65536)
    assert [r.total_bytes for r in cost.ranks] == [
        m.total for m in rank_memory(plan, tables, 65536, OptimizerFootprint(), 4)
    ]
    assert cost.peak_bytes <= topo.hbm_bytes_per_rank


# --------------------------------------------------------------------------------------------
# Report and CLI


def test_format_plan_lists_tables_ranks_and_a_summary():
    plan, tables = hand_plan()
    cost = estimate_cost(plan, tables, Topology(2, GIB), 8)
    text = format_plan(plan, cost, tables)
    assert "0:all" in text and "0:cols[0:4] 1:cols[4:8]" in text and "0-1:all" in text
    lines = text.splitlines()
    assert any(line.split()[:2] == ["0", "3"] for line in lines)  # rank 0 holds 3 shards
    assert lines[-1].startswith("400 B of tables over 2 ranks, peak rank")


def test_cli_plans_the_113b_model(capsys):
    assert main("--model dlrm_1tb_uncapped --world-size 8 --hbm-gb 80".split()) == 0
    out = capsys.readouterr().out
    assert "cat_19" in out and "column_wise" in out
    assert "over 8 ranks, peak rank" in out and "of 75.0 GiB budget" in out


def test_cli_reports_plans_that_do_not_fit(capsys):
    assert main("--model dlrm_1tb_uncapped --world-size 4 --hbm-gb 80 --no-host".split()) == 2
    err = capsys.readouterr().err
    assert "rank 3: needs" in err and "GiB" in err
    # without --no-host, auto keeps the largest tables in host memory instead
    assert main("--model dlrm_1tb_uncapped --world-size 4 --hbm-gb 80".split()) == 0
    assert "@host(cache" in capsys.readouterr().out


def test_cli_accepts_a_yaml_path_and_rejects_bad_input(capsys, tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text(
        "name: m\nembedding_dim: 8\nnum_embeddings_per_feature: [100, 5]\n"
        "hotness: [2, 1]\npooling: mean\nbottom_mlp: [32, 8]\n"
    )
    argv = ["--model", str(model)] + (
        "--world-size 2 --batch-size 64 --mode row_wise --optimizer adam --weight-bytes 2".split()
    )
    assert main(argv) == 0
    assert "row_wise" in capsys.readouterr().out
    assert main(["--model", "no_such_model"]) == 2
    assert "dlrm_kaggle" in capsys.readouterr().err  # lists the known models
    assert main(["--world-size", "3", "--batch-size", "100"]) == 2
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0


# --------------------------------------------------------------------------------------------
# Host-resident tables (sharding=host, auto past the budget)


def test_host_mode_caches_a_fraction_never_below_two_batches():
    plan = plan_sharding(UNEVEN, Topology(1, GIB), "host", 64, cache=CachePolicy(0.01))
    check_plan(plan, UNEVEN, GIB, 64)
    cache = {tp.table: tp.shards[0].cache_rows for tp in plan.tables}
    # 1% of the rows, but at least two batches' ids (64 x hotness x 2), at most the table
    assert cache == {"huge": 20_000, "big": 3_000, "mid": 200, "small": 256, "tiny": 3}
    assert all(tp.reason.startswith("host memory, device cache") for tp in plan.tables)
    assert host_memory(plan, SGD, 4) == [sum(t.num_rows * t.dim * 4 for t in UNEVEN)]
    adam = OptimizerFootprint.for_optimizer("adam")
    assert host_memory(plan, adam, 2) == [sum(t.num_rows * t.dim * 10 for t in UNEVEN)]


def test_host_mode_on_three_ranks_splits_rows_and_sizes_caches_by_gb():
    plan = plan_sharding(UNEVEN, Topology(3, GIB), "host", 192, cache=CachePolicy(gb=0.01))
    check_plan(plan, UNEVEN, GIB, 192)
    huge = plan.table("huge")
    assert huge.sharding is ShardingType.ROW_WISE and [s.rank for s in huge.shards] == [0, 1, 2]
    # one fraction for every table, so that rank 0's caches take 0.01 GiB
    per_row = 64 * 4 + CACHE_META_BYTES  # fp32 row + its bookkeeping
    cached = sum(s.cache_rows for tp in plan.tables for s in tp.shards if s.rank == 0)
    assert cached * per_row == pytest.approx(0.01 * GIB, rel=0.02)


def test_auto_moves_the_largest_tables_to_host_only_when_needed():
    topo = Topology(1, 200 * MIB)
    cache = CachePolicy(0.05)
    with pytest.raises(PlannerError):  # no cache policy: auto never uses host memory
        plan_sharding(UNEVEN, topo, "auto", 64)
    plan = plan_sharding(UNEVEN, topo, "auto", 64, cache=cache)
    check_plan(plan, UNEVEN, topo.hbm_bytes_per_rank, 64)
    on_host = [tp.table for tp in plan.tables if tp.shards[0].on_host]
    assert on_host == ["huge"]  # 2M x 64 x 4 = 488 MiB; the rest fits next to its cache
    assert plan.table("huge").reason.startswith("> device budget: host memory")
    # a budget that holds everything: nothing moves
    roomy = plan_sharding(UNEVEN, Topology(1, GIB), "auto", 64, cache=cache)
    assert not any(s.on_host for tp in roomy.tables for s in tp.shards)
    text = format_plan(plan, estimate_cost(plan, UNEVEN, topo, 64), UNEVEN)
    assert "0:all@host(cache 100K)" in text


def test_auto_with_host_still_fails_clearly_when_the_caches_do_not_fit():
    with pytest.raises(PlannerError, match="even with .* in host memory") as info:
        plan_sharding(UNEVEN, Topology(1, 2 * MIB), "auto", 64, cache=CachePolicy(0.5))
    assert "cache_fraction" in str(info.value)


def test_cache_policy_rejects_bad_values():
    with pytest.raises(ValueError, match="fraction must be in"):
        CachePolicy(0.0)
    with pytest.raises(ValueError, match="GB must be > 0"):
        CachePolicy(gb=-1)


def test_cli_shows_host_placement_and_host_memory(capsys):
    code = main(
        ["--model", "dlrm_1tb", "--world-size", "1", "--hbm-gb", "80", "--reserve-gb", "64"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "cat_0" in out and "@host(cache" in out
    assert "host memory per rank for host-resident tables" in out


# --------------------------------------------------------------------------------------------
# Per-table pins (sharding.tables)

PINNED = "pinned by sharding.tables: "


@pytest.mark.parametrize("mode", ["table_wise", "column_wise", "row_wise", "auto", "host"])
@pytest.mark.parametrize("world", [2, 3])
def test_pinned_tables_get_their_mode_and_the_rest_follow_the_mode(mode, world):
    pins = {"huge": "row_wise", "mid": "column_wise", "small": "data_parallel", "tiny": "host"}
    batch = 64 * world
    plan = plan_sharding(
        UNEVEN, Topology(world, GIB), mode, batch, cache=CachePolicy(0.05), pins=pins
    )
    check_plan(plan, UNEVEN, GIB, batch)
    assert plan.table("huge").sharding is ShardingType.ROW_WISE
    assert plan.table("mid").sharding is ShardingType.COLUMN_WISE
    assert len(plan.table("mid").shards) == world
    assert plan.table("small").sharding is ShardingType.DATA_PARALLEL
    assert all(s.on_host for s in plan.table("tiny").shards)
    assert all(plan.table(name).reason.startswith(PINNED) for name in pins)
    free = plan.table("big")
    assert not free.reason.startswith(PINNED)
    assert any(s.on_host for s in free.shards) == (mode == "host")
    unpinned = plan_sharding(UNEVEN, Topology(world, GIB), mode, batch, cache=CachePolicy(0.05))
    if mode in ("row_wise", "host"):  # fixed placements: pins of other tables change nothing
        assert free == unpinned.table("big")


def test_free_tables_are_placed_around_pinned_ones():
    tables = [
        TableConfig("a", 40_000, 64),
        TableConfig("b", 20_000, 64),
        TableConfig("c", 20_000, 64),
    ]
    plan = plan_sharding(tables, Topology(2, GIB), "table_wise", 64, pins={"a": "table_wise"})
    rank_a = plan.table("a").shards[0].rank
    assert [plan.table(n).shards[0].rank for n in ("b", "c")] == [1 - rank_a] * 2
    assert plan.table("a").reason == f"{PINNED}whole on rank {rank_a}"


def test_pinned_and_moved_host_tables_share_the_cache_budget():
    # auto past the budget: 'huge' moves to host next to the pinned 'tiny'; with cache_gb one
    # fraction covers both, so rank 0's caches still take cache_gb
    topo, cache = Topology(1, 200 * MIB), CachePolicy(gb=0.01)
    plan = plan_sharding(UNEVEN, topo, "auto", 64, cache=cache, pins={"mid": "host"})
    check_plan(plan, UNEVEN, topo.hbm_bytes_per_rank, 64)
    assert plan.table("mid").reason.startswith(f"{PINNED}host memory, device cache")
    assert plan.table("huge").reason.startswith("> device budget: host memory")
    per_row = 64 * 4 + CACHE_META_BYTES
    cached = sum(s.cache_rows for tp in plan.tables for s in tp.shards if s.on_host)
    assert cached * per_row == pytest.approx(0.01 * GIB, rel=0.02)


def test_bad_pins_are_named():
    topo = Topology(2, GIB)
    with pytest.raises(ValueError, match=r"unknown table\(s\) nope; the tables are huge, big"):
        plan_sharding(UNEVEN, topo, "auto", 64, pins={"nope": "row_wise"})
    with pytest.raises(ValueError, match=r"sharding.tables.big='rows' is not one of: table_wise"):
        plan_sharding(UNEVEN, topo, "auto", 64, pins={"big": "rows"})
    with pytest.raises(PlannerError, match="table 'huge' pinned table_wise .* fits on no rank"):
        plan_sharding(UNEVEN, Topology(2, 200 * MIB), "row_wise", 64, pins={"huge": "table_wise"})


def test_cli_pins_tables(capsys):
    args = ["--model", "dlrm_kaggle", "--world-size", "2", "--hbm-gb", "80"]
    assert main([*args, "--pin", "cat_2=row_wise", "--mode", "table_wise"]) == 0
    out = capsys.readouterr().out
    assert "pinned by sharding.tables: 2 row ranges" in out
    assert main([*args, "--pin", "cat_2"]) == 2
    assert "expected TABLE=MODE" in capsys.readouterr().err
