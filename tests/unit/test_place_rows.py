"""The output dist's in-place assembly (hybridrec.sparse.exchange.output.place_rows) against
the per-unit one (`reassemble`), with no processes: for every rank of simulated row-, table-
and pinned mixed plans of sequence layouts, the same received rows (as `pack` numbers them
from that rank's ids) give a bitwise equal output (place_rows' features apart, side by side),
and the same gradient of the received rows (the 1/W scale included), also when the loss
reads one feature alone. Layouts `rows_in_place` must refuse are listed too."""

from __future__ import annotations

import pytest
import torch

from hybridrec.planner import Topology, plan_sharding
from hybridrec.sparse.exchange.output import place_rows, reassemble, rows_in_place
from hybridrec.sparse.exchange.routing import build_routes, pack
from hybridrec.sparse.layout import ShardedLayout
from hybridrec.types import PAD_ID, Pooling, TableConfig

TABLES = [
    TableConfig("history", 300, 4, hotness=6, pooling=Pooling.NONE, storage="item"),
    TableConfig("cats", 20, 4, hotness=6, pooling=Pooling.NONE),
    TableConfig("target", 300, 4, storage="item"),
    TableConfig("item", 300, 4, hotness=3),  # a multi-hot bag: row-wise partial sums add
    TableConfig("tags", 40, 4, hotness=2, jagged=True),
]


def _ids(g: torch.Generator, b: int) -> torch.Tensor:
    cols = []
    for t in TABLES:
        x = torch.randint(0, t.num_rows, (b, t.hotness), generator=g)
        if t.jagged:  # lengths 0..hotness, padding at the end
            n = torch.randint(0, t.hotness + 1, (b, 1), generator=g)
            x = torch.where(torch.arange(t.hotness) < n, x, PAD_ID)
        cols.append(x)
    return torch.cat(cols, dim=1)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "mode,pins",
    [("row_wise", None), ("table_wise", None), ("table_wise", {"item": "row_wise"})],
)
def test_place_rows_equals_reassemble_bitwise(world, mode, pins):
    plan = plan_sharding(TABLES, Topology(world, 1 << 30), mode, 8 * world, pins=pins)
    g = torch.Generator().manual_seed(world)
    b_local = 8
    for rank in range(world):
        layout = ShardedLayout.build(TABLES, plan, rank)
        assert rows_in_place(layout), f"{mode} {pins} rank {rank}"
        packed = pack(_ids(g, b_local), build_routes(layout, torch.device("cpu")))
        widths = [u.shard.width for units in layout.units_on for u in units]
        rows = [n for per_rank in packed.recv_rows for n in per_rank]
        flat = torch.randn(sum(n * w for n, w in zip(rows, widths, strict=True)), generator=g)
        flat[::7] = 0.0  # zeros (a row that sums to 0 + 0)
        grad = None
        outs, grads, firsts = [], [], []
        for in_place in (False, True):
            recv = flat.clone().requires_grad_()
            scale = 1.0 / world
            if in_place:  # each feature's [B_l, S_f, D]
                parts = place_rows(recv, packed.kept, layout, b_local, scale)
                assert [p.shape[1] for p in parts] == [t.slots for t in TABLES]
                out = torch.cat(parts, dim=1)
            else:
                units = [
                    part.view(n, w)
                    for part, n, w in zip(
                        torch.split(recv, [n * w for n, w in zip(rows, widths, strict=True)]),
                        rows, widths, strict=True,
                    )
                ]  # fmt: skip
                replicated = recv.new_zeros(b_local, 0)
                out = reassemble(units, packed.kept, replicated, layout, {}, scale)
            if grad is None:
                grad = torch.randn(out.shape, generator=g)
            out.backward(grad, retain_graph=True)
            outs.append(out.detach())
            grads.append(recv.grad)
            # a loss that reads the history alone: the other features' rows get zeros
            recv.grad = None
            first = parts[0] if in_place else out[:, :6]
            first.backward(grad[:, :6])
            firsts.append(recv.grad)
        label = f"W={world} {mode} {pins} rank {rank}"
        assert outs[0].shape == outs[1].shape == (b_local, 6 + 6 + 1 + 1 + 1, 4), label
        assert torch.equal(outs[0], outs[1]), label
        assert torch.equal(grads[0], grads[1]), label
        assert torch.equal(firsts[0], firsts[1]), label


def test_rows_in_place_refuses_what_it_cannot_build():
    mean = TableConfig("mean_tags", 40, 4, hotness=2, jagged=True, pooling=Pooling.MEAN)
    cases = {
        "a jagged mean": ([*TABLES, mean], "row_wise", None),
        "column-wise": (TABLES, "table_wise", {"cats": "column_wise"}),
        "replicated": (TABLES, "table_wise", {"cats": "data_parallel"}),
        "no sequence": (TABLES[2:], "row_wise", None),
        "two widths": ([*TABLES, TableConfig("wide", 9, 8)], "row_wise", None),
    }
    for label, (tables, mode, pins) in cases.items():
        plan = plan_sharding(tables, Topology(2, 1 << 30), mode, 16, pins=pins)
        assert not rows_in_place(ShardedLayout.build(tables, plan, 0)), label
