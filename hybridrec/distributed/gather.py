"""An all-gather with a gradient: every rank's rows on every rank, each rank's gradient of a
row summed back into the rank that owns it.

    everyone = gather_with_grad(mine, group)      # [b, D] on each rank -> [W * b, D]

The forward is comm.all_gather_rows (rank p's rows at block p). The backward sums, for each
rank p, the gradients that every rank computed for block p, and hands the sum to rank p: an
all-to-all of the blocks (comm.all_to_all), then a sum over senders, i.e. a reduce-scatter.

Why a sum, and how it composes with the gradient-scaling convention (hybridrec.shard): rank
r's loss L_r is a mean over its own b rows, and the run's objective is G = (1/W) sum_r L_r,
the one-process loss on the global batch. A gathered row v (owned by rank p) enters every
rank's loss, so dG/dv = (1/W) sum_r dL_r/dv. The backward gives rank p the sum
sum_r dL_r/dv; the 1/W is applied where it always is: the embedding exchanges scale what
leaves the model by 1/W (an embedding row of v gets exactly dG/dv), and DDP averages the dense
gradients over the W ranks (a dense weight that made v, an item tower's MLP on rank p, gets
(1/W) sum_r dL_r/dv dv/dw, its share of dG/dw). So the loss, the rows, their optimizer state
and the dense weights are those of one process on the global batch, at any world size.

Every rank must pass the same number of rows (the trainer's slices are equal). On one
process (group None or one rank) it is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybridrec.distributed.comm import all_gather_rows, all_to_all, world_size


class _GatherRows(torch.autograd.Function):
    """[b, *] on each rank -> [W * b, *]; backward: the sum over ranks of each block's
    gradient, on the block's own rank."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.name, ctx.rows = group, name, x.shape[0]
        return all_gather_rows(x, group, name=name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        world, b = world_size(ctx.group), ctx.rows
        # block p of `grad` is this rank's gradient of rank p's rows: send it there
        received = all_to_all(grad.contiguous(), [b] * world, [b] * world, ctx.group, name=ctx.name)
        return received.view(world, b, *grad.shape[1:]).sum(0), None, None


def gather_with_grad(
    x: torch.Tensor, group: dist.ProcessGroup | None, name: str = "gather_with_grad"
) -> torch.Tensor:
    """Every rank's `x` [b, *] (the same b everywhere), as [W * b, *] with rank p's rows at
    block p; gradients flow back summed into each row's own rank (module docstring). `x`
    itself on one process."""
    if world_size(group) == 1:
        return x
    return _GatherRows.apply(x, group, name)
