"""The input dist's routing (hybridrec.sparse.exchange.routing and .input) on W simulated
ranks, no processes.

Every rank packs its ids (`pack`), each rank's received buffer is put together from what the
others packed for it, and `group_inputs` turns it into the group lookups. The result is held
against a direct, loop-by-loop reading of the plan: for every receiving rank, group, source
rank, unit and sample, the ids that unit must see (shifted to its shard, plus its slot's
offset), in that order, in bags numbered in that order, with no bag for a sample that has no
id in a row-wise shard (compact), and the per-rank row counts the output dist relies on.
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.planner import Topology, plan_sharding
from hybridrec.sparse.exchange.input import group_inputs
from hybridrec.sparse.exchange.routing import build_routes, pack
from hybridrec.sparse.layout import ShardedLayout
from hybridrec.types import PAD_ID, Pooling, TableConfig

TABLES = [
    TableConfig("tw", 50, 4, hotness=2),
    TableConfig("rw", 100, 4, hotness=1),
    TableConfig("rw_list", 90, 4, hotness=3, jagged=True, pooling=Pooling.MEAN),
    TableConfig("cw", 40, 8, hotness=1, pooling=Pooling.SUM),
    TableConfig("list", 30, 4, hotness=2, jagged=True),
    TableConfig("mean", 20, 4, hotness=2, pooling=Pooling.MEAN),
    TableConfig("follows", 100, 4, hotness=2, jagged=True, storage="rw"),  # shares rw's rows
]
PINS = {"tw": "table_wise", "rw": "row_wise", "rw_list": "row_wise", "cw": "column_wise"}
# every unit of a group takes 2 ids per sample (group_inputs' broadcast path), mean and sum
FIXED = [
    TableConfig(f"t{i}", 10 + 7 * i, 4, hotness=2, pooling=Pooling(p))
    for i, p in enumerate(["mean", "sum", "mean", "sum", "mean"])
]


def _ids(g: torch.Generator, b: int, tables) -> torch.Tensor:
    cols = []
    for t in tables:
        x = torch.randint(0, t.num_rows, (b, t.hotness), generator=g)
        if t.jagged:  # random lengths, some bags empty, padding at the end of a bag
            n = torch.randint(0, t.hotness + 1, (b, 1), generator=g)
            x = torch.where(torch.arange(t.hotness) < n, x, PAD_ID)
        cols.append(x)
    return torch.cat(cols, dim=1)


def _expected(layouts, ids, b_local, q):
    """Per group key of rank q: (rows, bags, scale, per_rank) read off the plan directly."""
    lay = layouts[q]
    offsets = lay.offsets
    out = {}
    for key, ks in lay.group_units.items():
        slot_rows = lay.slot_rows(key)
        slots = lay.input_slots(key)
        rows, bags, scale, per_rank = [], [], [], []
        bag = 0
        for part in ids:
            n_bags = 0
            for k, pos in zip(ks, slots, strict=True):
                u = lay.local_units[k]
                cols = part[:, offsets[u.table_index] : offsets[u.table_index + 1]]
                s = u.shard
                for b in range(b_local):
                    got = [int(i) for i in cols[b] if i >= 0]
                    if u.row_wise:
                        got = [i - s.row_start for i in got if s.row_start <= i < s.row_end]
                        if not got:
                            continue  # compact: no bag
                    rows += [slot_rows[pos] + i for i in got]
                    bags += [bag] * len(got)
                    mean = u.table.pooling == Pooling.MEAN and not u.table.jagged
                    scale += [1.0 / u.table.hotness if mean else 1.0] * len(got)
                    bag += 1
                    n_bags += 1
            per_rank.append(n_bags)
        out[key] = (rows, bags, scale, per_rank)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("tables,pins", [(TABLES, PINS), (FIXED, {})], ids=["mixed", "fixed"])
def test_routing_gives_each_group_its_units_ids_in_send_order(world, tables, pins):
    plan = plan_sharding(tables, Topology(world, 1 << 30), "table_wise", 12 * world, pins=pins)
    layouts = [ShardedLayout.build(tables, plan, r) for r in range(world)]
    routes = [build_routes(lay, torch.device("cpu")) for lay in layouts]
    g = torch.Generator().manual_seed(world)
    b_local = 12
    ids = [_ids(g, b_local, tables) for _ in range(world)]
    flags = [r == world - 1 for r in range(world)]
    packed = [pack(ids[r], routes[r], flags[r]) for r in range(world)]
    for q in range(world):
        pieces, out_splits = [], []
        for p in range(world):
            flat = torch.cat(packed[p].chunks)
            start = sum(packed[p].in_splits[:q])
            pieces.append(flat[start : start + packed[p].in_splits[q]])
            out_splits.append(packed[p].in_splits[q])
        groups, flagged = group_inputs(torch.cat(pieces), out_splits, b_local, world, routes[q])
        assert flagged  # the last rank flagged a bad id: every rank learns it
        want = _expected(layouts, ids, b_local, q)
        assert set(groups) == set(want)
        for key, (rows, bags, scale, per_rank) in want.items():
            got = groups[key]
            assert got.rows.tolist() == rows, key
            assert got.bags.tolist() == bags, key
            assert got.per_rank == per_rank and got.num_bags == sum(per_rank), key
            if got.scale is None:
                assert all(s == 1.0 for s in scale)
            else:
                assert got.scale.tolist() == pytest.approx(scale)
        # what each sender expects back from q: the rows q's groups send it
        for p in range(world):
            units = layouts[p].units_on[q]
            first = sum(len(layouts[p].units_on[r]) for r in range(q))
            rows_back = packed[p].recv_rows[q]
            assert sum(rows_back) == sum(want[key][3][p] for key in want)
            for k, (u, n) in enumerate(zip(units, rows_back, strict=True)):
                if u.row_wise:  # compact: the samples of p with an id in the shard
                    samples = packed[p].kept[first + k].tolist()
                    cols = ids[p][:, layouts[p].offsets[u.table_index] :][:, : u.table.hotness]
                    inside = (cols >= u.shard.row_start) & (cols < u.shard.row_end)
                    assert samples == inside.any(1).nonzero().squeeze(1).tolist()
                    assert n == len(samples)
                else:
                    assert n == b_local
