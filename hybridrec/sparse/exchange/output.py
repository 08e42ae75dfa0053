"""Output dist: each local group's pooled rows, already in send order (bags numbered by
source rank, unit and sample: hybridrec.sparse.exchange.input), go back to the ranks whose samples
they are, and each rank rebuilds its tables (table-wise: the unit as is; column-wise: slices
concatenated in column order; row-wise: the compact partial sums added, in shard order, at
the samples they belong to; a sequence's rows, one per id, put at their positions; replicated
tables: looked up locally; jagged means: divided by
their bags' lengths) as [B_l, T, D], or [B_l, sum_t D_t] when the tables' widths differ.

One differentiable all_to_all_single (`OutputExchange`), in the collection's comm dtype
(fp32: exact) or, with a hand-off dtype (bf16 under autocast, whole values only), in that
dtype both ways (the step's `Wire`). Its backward runs every collective of the embedding
side's backward in one fixed order on every rank: the all-to-all in reverse, then the
exchange's `after_backward(step, ...)` (row-statistic sharing, then the replicated tables'
sync). One node makes that order explicit instead of a property of autograd's scheduling.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hybridrec.distributed.comm import CommStats, ScaleGrad, all_to_all
from hybridrec.sparse.bags import jagged_means
from hybridrec.sparse.layout import GroupKey, ShardedLayout
from hybridrec.sparse.step import StepContext


class AfterBackward(Protocol):
    """What runs in the output dist's backward after its all-to-all (on every rank)."""

    def after_backward(
        self, step: StepContext, grad_send: torch.Tensor, grad_replicated: torch.Tensor
    ) -> None: ...


class OutputExchange(torch.autograd.Function):
    """Forward: the all-to-all of `send` (the groups' pooled rows, flat) fp32 (in the step's
    wire dtype, back to fp32 on arrival, or kept in the hand-off dtype); `replicated` passes
    through. Backward: the all-to-all in reverse (with a hand-off dtype: in it, then scaled by
    the wire's scale in fp32), then `work.after_backward(step, grad_send, grad_replicated)`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        send: torch.Tensor,
        replicated: torch.Tensor,
        splits: tuple[list[int], list[int]],
        group: dist.ProcessGroup,
        stats: CommStats | None,
        step: StepContext,
        work: AfterBackward,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_splits, in_splits = splits
        ctx.splits, ctx.group, ctx.stats, ctx.step, ctx.work = splits, group, stats, step, work
        wire = step.wire
        recv = all_to_all(send.to(wire.dtype), out_splits, in_splits, group, stats, "output_dist")
        return (recv if wire.keep else recv.float()), replicated.view_as(replicated)

    @staticmethod
    def backward(ctx: Any, grad_recv: torch.Tensor, grad_replicated: torch.Tensor) -> tuple:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        wire = ctx.step.wire
        grad_send = all_to_all(
            grad_recv.to(wire.dtype).contiguous(),
            in_splits,
            out_splits,
            ctx.group,
            ctx.stats,
            "output_dist.backward",
        ).float()
        grad_replicated = grad_replicated.float()
        if wire.scale != 1.0:  # the hand-off's 1/W: the product ScaleGrad forms in fp32
            grad_send = grad_send * wire.scale
            grad_replicated = grad_replicated * wire.scale
        ctx.work.after_backward(ctx.step, grad_send, grad_replicated)
        return grad_send, None, None, None, None, None, None


def _blocks(step: StepContext, world: int) -> Iterator[tuple[GroupKey, int, int]]:
    """The send buffer's blocks in order, rank by rank and each rank's group by group:
    (group key, first row in the group's output, rows)."""
    starts = dict.fromkeys(step.lookups, 0)
    for p in range(world):
        for key, inp in step.lookups.items():
            n = inp.per_rank[p]
            yield key, starts[key], n
            starts[key] += n


def send_order(pooled: dict[GroupKey, torch.Tensor], step: StepContext, world: int) -> torch.Tensor:
    """The groups' pooled rows [n_g, w_g] (bags in (source rank, unit, sample) order) as the
    flat send buffer. One group: its output as it is (a view, no copy either way)."""
    if len(step.lookups) == 1:
        [key] = step.lookups
        return pooled[key].reshape(-1)
    return torch.cat([pooled[key][a : a + n].reshape(-1) for key, a, n in _blocks(step, world)])


def group_grads(grad: torch.Tensor, step: StepContext, world: int) -> dict[GroupKey, torch.Tensor]:
    """The inverse of `send_order`: the flat gradient -> each group's [n_g, w_g]."""
    if len(step.lookups) == 1:
        [key] = step.lookups
        return {key: grad.view(-1, key.width)}
    pieces: dict[GroupKey, list[torch.Tensor]] = {key: [] for key in step.lookups}
    at = 0
    for key, _, n in _blocks(step, world):
        pieces[key].append(grad[at : at + n * key.width])
        at += n * key.width
    return {key: torch.cat(ps).view(-1, key.width) for key, ps in pieces.items()}


def output_dist(
    pooled: dict[GroupKey, torch.Tensor],
    replicated: torch.Tensor,
    step: StepContext,
    layout: ShardedLayout,
    group: dist.ProcessGroup,
    stats: CommStats | None,
    work: AfterBackward,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The local groups' pooled rows -> every unit's rows for this rank's samples, [n, w_u] in
    received order (n = B_l, or a compact unit's kept samples); `replicated` [B_l, sum D_dp]
    passes through the same autograd node, whose backward ends with `work.after_backward`."""
    recv, replicated = exchange_rows(pooled, replicated, step, layout, group, stats, work)
    assert step.receipt is not None
    units = []
    for q, rows in enumerate(step.receipt.recv_rows):
        for n, u in zip(rows, layout.units_on[q], strict=True):
            units.append(n * u.shard.width)
    parts = torch.split(recv, units)
    widths = [u.shard.width for us in layout.units_on for u in us]
    return [part.view(-1, w) for part, w in zip(parts, widths, strict=True)], replicated


def exchange_rows(
    pooled: dict[GroupKey, torch.Tensor],
    replicated: torch.Tensor,
    step: StepContext,
    layout: ShardedLayout,
    group: dist.ProcessGroup,
    stats: CommStats | None,
    work: AfterBackward,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`output_dist`'s exchange: (every unit's rows for this rank's samples, flat, in
    received order (source rank, then its units in order), `replicated` passed through)."""
    world = layout.world
    assert step.receipt is not None, "the all-to-all's step context carries its receipt"
    if step.lookups:
        send = send_order(pooled, step, world)
    else:
        send = torch.zeros(0, device=replicated.device)
    if torch.is_grad_enabled() and not send.requires_grad:
        send = send.detach().requires_grad_()  # this rank must still join the backward
    in_splits = [
        sum(g.per_rank[p] * key.width for key, g in step.lookups.items()) for p in range(world)
    ]
    out_splits = [
        sum(n * u.shard.width for n, u in zip(rows, units, strict=True))
        for rows, units in zip(step.receipt.recv_rows, layout.units_on, strict=True)
    ]
    return OutputExchange.apply(send, replicated, (out_splits, in_splits), group, stats, step, work)


def rows_in_place(layout: ShardedLayout) -> bool:
    """Whether `place_rows` builds this layout's output: one width, with sequences, and every
    feature's units received as its rows of that width (no replicated, column-wise or jagged
    mean feature), each feature's shards in received order (the order its partial sums add)."""
    if not (layout.one_width and layout.sequences) or layout.dp_tables:
        return False
    means = jagged_means(layout.tables)
    for f, where in layout.table_units.items():
        traits = layout.plan.tables[layout.storage_of[f]].sharding.traits
        if traits.concatenated or f in means or where != sorted(where):
            return False
    return True


def place_rows(
    recv: torch.Tensor,
    kept: dict[int, torch.Tensor],
    layout: ShardedLayout,
    b_local: int,
    scale: float | None,
) -> tuple[torch.Tensor, ...]:
    """`reassemble` of a layout `rows_in_place` accepts, feature by feature, from the flat
    received rows: each feature's [B_l, S_f, D] (S_f: a sequence's length L_f, else 1), its
    units' rows added into zeros in received order at their rows there: a sequence's kept
    b * L_f + j, a compact unit's kept sample b, else every sample in order. The same sums in
    the same order as `_sequence_output` (a row-wise feature's shards in received order are
    its shard order). Handed over apart (Pooled takes them), not as one [B_l, S, D] that the
    model splits: that split's backward writes the whole gradient again (a cat of the parts),
    where `_PlaceRows` gathers each received row's gradient from its feature's own."""
    width = layout.tables[0].dim
    every = torch.arange(b_local, device=recv.device)  # a unit with a row per sample
    pieces, position = [], 0
    for units in layout.units_on:
        for u in units:
            pieces.append((u.table_index, kept.get(position, every)))
            position += 1
    sizes = [b_local * t.slots for t in layout.tables]
    parts = _PlaceRows.apply(recv.view(-1, width), pieces, sizes, scale)
    return tuple(p.view(b_local, t.slots, width) for p, t in zip(parts, layout.tables, strict=True))


class _PlaceRows(torch.autograd.Function):
    """Rows [m, D] -> one [n_f, D] per feature (`sizes`): zeros with each piece (feature f,
    rows at [i_f] of its output; the pieces take the rows in order) added by index_add_.
    Backward: each piece's rows gathered from its feature's gradient (zeros for a feature
    the loss did not read), times `scale` in place (ScaleGrad's 1/W, the same product)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        rows: torch.Tensor,
        pieces: list[tuple[int, torch.Tensor]],
        sizes: list[int],
        scale: float | None,
    ) -> tuple[torch.Tensor, ...]:
        outs = [rows.new_zeros(n, rows.shape[1]) for n in sizes]
        spans, a = [], 0
        for f, at in pieces:
            outs[f].index_add_(0, at, rows[a : a + at.numel()])
            spans.append((f, a, a + at.numel()))
            a += at.numel()
        assert a == rows.shape[0], "every received row has its place"
        ctx.save_for_backward(*[at for _, at in pieces])
        ctx.spans, ctx.scale, ctx.shape = spans, scale, rows.shape
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:  # type: ignore[override]
        given = [g for g in grads if g is not None]
        if not given:
            return None, None, None, None
        out = given[0].new_empty(ctx.shape)
        for (f, a, b), at in zip(ctx.spans, ctx.saved_tensors, strict=True):
            g = grads[f]
            if g is None:
                out[a:b].zero_()
            else:
                torch.index_select(g, 0, at, out=out[a:b])
        if ctx.scale is not None:
            out.mul_(ctx.scale)
        return out, None, None, None


def _placed(rows: torch.Tensor, at: torch.Tensor, n: int) -> torch.Tensor:
    """[n, w]: zeros with rows [m, w] added at rows `at` [m]."""
    return rows.new_zeros(n, rows.shape[1]).index_add_(0, at, rows)


def _table_piece(
    i: int,
    received: list[torch.Tensor],
    kept: dict[int, torch.Tensor],
    replicated: torch.Tensor,
    layout: ShardedLayout,
) -> torch.Tensor:
    """Feature i's rows for this rank's samples, [B_l * S_i, D_i] ([B_l, S_i * D_i] for a
    replicated table), from its received units (see `reassemble`)."""
    t, n = layout.tables[i], replicated.shape[0] * layout.tables[i].slots
    if i in layout.dp_columns:
        a, b = layout.dp_columns[i]
        return replicated[:, a:b]
    where = layout.table_units[i]
    traits = layout.plan.tables[layout.storage_of[i]].sharding.traits
    if traits.concatenated:  # (a sequence's column slices: each at its positions)
        parts = [_placed(received[p], kept[p], n) if t.sequence else received[p] for p in where]
        return torch.cat(parts, dim=1)
    if traits.partial_sums or t.sequence:  # added in shard order
        first = received[where[0]]
        piece = first.new_zeros(n, first.shape[1])
        for p in where:
            piece.index_add_(0, kept[p], received[p])
        return piece
    return received[where[0]]


def reassemble(
    received: list[torch.Tensor],
    kept: dict[int, torch.Tensor],
    replicated: torch.Tensor,
    layout: ShardedLayout,
    divisors: dict[int, torch.Tensor],
    scale: float | None = None,
) -> torch.Tensor:
    """Received units [n, w_u] and replicated tables [B_l, sum D_dp] -> pooled [B_l, S, D]
    ([B_l, sum_t S_t * D_t] for mixed widths; S_t: a sequence's length, else 1); `kept`: the
    samples of compact (row-wise) units' rows, the positions of a sequence's; `divisors`:
    bag lengths [B_l, 1] of jagged mean tables; `scale`: the factor of the gradient of what
    leaves (the 1/W of the gradient-scaling rule; None: 1). One width with sequences:
    `_sequence_output`."""
    if layout.sequences and layout.one_width:
        return _sequence_output(received, kept, replicated, layout, divisors, scale)
    b_local = replicated.shape[0]
    per_table = []
    for i in range(len(layout.tables)):
        piece = _table_piece(i, received, kept, replicated, layout)
        per_table.append(piece / divisors[i] if i in divisors else piece)
    if not layout.sequences:
        out = torch.stack(per_table, dim=1) if layout.one_width else torch.cat(per_table, dim=1)
    else:
        out = torch.cat([p.reshape(b_local, -1) for p in per_table], dim=1)
    return out if scale is None else ScaleGrad.apply(out, scale)


def _sequence_output(
    received: list[torch.Tensor],
    kept: dict[int, torch.Tensor],
    replicated: torch.Tensor,
    layout: ShardedLayout,
    divisors: dict[int, torch.Tensor],
    scale: float | None,
) -> torch.Tensor:
    """`reassemble` of a one-width layout with sequences, written into one [B_l * S, D]
    buffer of zeros: a table- or row-wise unit's received rows are added in place at their
    rows of it (sample b, the feature's first slot s_f, position j: b * S + s_f + j), in shard
    order; a replicated, column-wise or mean feature is assembled first (`_table_piece`) and
    added the same way. So the forward fills and writes the output once (no zeros per
    sequence and no cat of [B_l, S, D]), the backward only gathers each unit's rows from the
    output's gradient, and the gradient's `scale` multiplies the rows as they arrived (one
    per id, not per padded position) or a mean's quotient: the same products as on the whole
    output, so the same bits."""
    b_local, width = replicated.shape[0], layout.tables[0].dim
    slots = sum(t.slots for t in layout.tables)
    out = replicated.new_zeros(b_local * slots, width)
    sample_row = torch.arange(b_local, device=out.device) * slots
    first = 0  # the feature's first slot
    for i, t in enumerate(layout.tables):
        traits = layout.plan.tables[layout.storage_of[i]].sharding.traits
        if i in layout.dp_columns or i in divisors or traits.concatenated:
            piece = _table_piece(i, received, kept, replicated, layout)
            piece = piece / divisors[i] if i in divisors else piece
            if scale is not None:
                piece = ScaleGrad.apply(piece, scale)
            at = (
                sample_row.view(-1, 1) + torch.arange(first, first + t.slots, device=out.device)
            ).view(-1)
            out.index_add_(0, at, piece.reshape(-1, width))
        else:
            for p in layout.table_units[i]:
                rows = received[p] if scale is None else ScaleGrad.apply(received[p], scale)
                if p not in kept:  # a row per sample, in sample order
                    at = sample_row + first
                else:  # kept: samples b (row-wise), or positions b * S_f + j (a sequence)
                    b, j = kept[p].div(t.slots, rounding_mode="floor"), kept[p] % t.slots
                    at = sample_row.index_select(0, b) + (j + first)
                out.index_add_(0, at, rows)
        first += t.slots
    return out.view(b_local, slots, width)
