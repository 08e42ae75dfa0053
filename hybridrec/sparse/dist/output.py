"""Output dist: each local unit's pooled rows [B, w_u] go back to the ranks whose samples
they are, and each rank rebuilds its tables (table-wise: the unit as is; column-wise: slices
concatenated in column order; row-wise: partial sums added in shard order; replicated
tables: looked up locally; jagged means: divided by their bags' lengths) as [B_l, T, D], or
[B_l, sum_t D_t] when the tables' widths differ.

One differentiable all_to_all_single (`Exchange`), in the collection's comm dtype (fp32:
exact) or, with a hand-off dtype (bf16 under autocast, whole values only), in that dtype
both ways. Its backward runs every collective of the embedding side's backward in one fixed
order on every rank: the all-to-all in reverse, then `after_backward` (row-statistic sharing,
then the replicated tables' sync). One node makes that order explicit instead of a property
of autograd's scheduling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hybridrec.distributed.comm import CommStats, all_to_all
from hybridrec.sparse.layout import ShardedLayout
from hybridrec.types import ShardingType

AfterBackward = Callable[[torch.Tensor, torch.Tensor], None]


class Exchange(torch.autograd.Function):
    """Forward: the all-to-all of `send` [W * B_l * width_on[rank]] fp32 (in `wire`, back to
    fp32 on arrival, or kept in the hand-off dtype); `replicated` passes through.
    Backward: the all-to-all in reverse (with a hand-off dtype: in it, then scaled by `scale`
    in fp32), then `after_backward(grad_send, grad_replicated)`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        send: torch.Tensor,
        replicated: torch.Tensor,
        splits: tuple[list[int], list[int]],
        group: dist.ProcessGroup,
        stats: CommStats | None,
        wire: tuple[torch.dtype, bool, float],
        after_backward: AfterBackward,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_splits, in_splits = splits
        ctx.splits, ctx.group, ctx.stats, ctx.after = splits, group, stats, after_backward
        ctx.wire, keep, ctx.scale = wire
        recv = all_to_all(send.to(ctx.wire), out_splits, in_splits, group, stats, "output_dist")
        return (recv if keep else recv.float()), replicated.view_as(replicated)

    @staticmethod
    def backward(ctx: Any, grad_recv: torch.Tensor, grad_replicated: torch.Tensor) -> tuple:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        grad_send = all_to_all(
            grad_recv.to(ctx.wire).contiguous(),
            in_splits,
            out_splits,
            ctx.group,
            ctx.stats,
            "output_dist.backward",
        ).float()
        grad_replicated = grad_replicated.float()
        if ctx.scale != 1.0:  # the hand-off's 1/W: the product ScaleGrad forms in fp32
            grad_send = grad_send * ctx.scale
            grad_replicated = grad_replicated * ctx.scale
        ctx.after(grad_send, grad_replicated)
        return grad_send, None, None, None, None, None, None


def output_dist(
    pooled: list[torch.Tensor],
    replicated: torch.Tensor,
    b_local: int,
    layout: ShardedLayout,
    group: dist.ProcessGroup,
    stats: CommStats | None,
    wire: tuple[torch.dtype, bool, float],
    after_backward: AfterBackward,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Local units' pooled [B, w_u] -> every unit's [B_l, w_u] for this rank's samples, in
    received order; `replicated` [B_l, sum D_dp] passes through the same autograd node.
    `wire`: (dtype on the wire, keep that dtype on arrival, backward scale)."""
    world, rank = layout.world, layout.rank
    device = replicated.device
    if pooled:
        send = torch.cat([p.reshape(world, -1) for p in pooled], dim=1).reshape(-1)
    else:
        send = torch.zeros(0, device=device)
    if torch.is_grad_enabled() and not send.requires_grad:
        send = send.detach().requires_grad_()  # this rank must still join the backward
    in_splits = [b_local * layout.width_on[rank]] * world
    out_splits = [b_local * w for w in layout.width_on]
    recv, replicated = Exchange.apply(
        send, replicated, (out_splits, in_splits), group, stats, wire, after_backward
    )
    units = []
    for q, chunk in enumerate(torch.split(recv, out_splits)):
        sizes = [b_local * u.shard.width for u in layout.units_on[q]]
        for u, part in zip(layout.units_on[q], torch.split(chunk, sizes), strict=True):
            units.append(part.view(b_local, u.shard.width))
    return units, replicated


def reassemble(
    received: list[torch.Tensor],
    replicated: torch.Tensor,
    layout: ShardedLayout,
    divisors: dict[int, torch.Tensor],
) -> torch.Tensor:
    """Received units [B_l, w_u] and replicated tables [B_l, sum D_dp] -> pooled [B_l, T, D]
    ([B_l, sum D] for mixed widths); `divisors`: bag lengths [B_l, 1] of jagged mean tables."""
    per_table = []
    for i in range(len(layout.tables)):
        if i in layout.dp_columns:
            a, b = layout.dp_columns[i]
            piece = replicated[:, a:b]
        else:
            pieces = [received[p] for p in layout.table_units[i]]
            if layout.plan.tables[layout.storage_of[i]].sharding == ShardingType.COLUMN_WISE:
                piece = torch.cat(pieces, dim=1)
            else:  # table-wise: one piece; row-wise: partial sums, added in shard order
                piece = pieces[0]
                for p in pieces[1:]:
                    piece = piece + p
        per_table.append(piece / divisors[i] if i in divisors else piece)
    return torch.stack(per_table, dim=1) if layout.one_width else torch.cat(per_table, dim=1)
