"""Collectives as small autograd Functions whose backward is the mirror exchange.

Everything takes its process group explicitly; nothing here knows about models or tables.
Shapes are per rank; W = world size, r = this rank.

- AllToAllSingle: x [sum(in_splits), *] -> y [sum(out_splits), *]; row block q of x goes to
  rank q, row block p of y came from rank p. Backward: the same exchange with the splits
  swapped. Uses all_to_all_single (gloo rejects list-form all_to_all with unequal sizes).
- LocalSlice: x [W*n, *] identical on every rank -> rows [r*n, (r+1)*n). Backward: all-gather
  of the slices' gradients, so every rank gets the full [W*n, *] gradient (data-parallel
  tables update their replicas from the whole global batch).
- ScaleGrad: identity forward, gradient times a constant (the 1/W of the gradient-scaling
  convention, see hybridrec.parallelize).

CommStats counts the bytes each exchange moves to and from *other* ranks, so tests can hold
the planner's cost model to the bytes actually sent.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class CommStats:
    """Bytes sent to / received from other ranks, per exchange name (self-sends excluded)."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = defaultdict(int)
        self.recv: dict[str, int] = defaultdict(int)

    def add(self, name: str, sent: int, recv: int) -> None:
        self.sent[name] += sent
        self.recv[name] += recv

    def reset(self) -> None:
        self.sent.clear()
        self.recv.clear()


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def all_to_all(
    x: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    group: dist.ProcessGroup,
    stats: CommStats | None = None,
    name: str = "all_to_all",
) -> torch.Tensor:
    """Plain (no autograd) all_to_all_single with uneven row splits along dim 0."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
    if stats is not None:
        rank, rb = dist.get_rank(group), _row_bytes(x)
        stats.add(
            name, (sum(in_splits) - in_splits[rank]) * rb, (sum(out_splits) - out_splits[rank]) * rb
        )
    return out


class AllToAllSingle(torch.autograd.Function):
    """Differentiable all_to_all_single; backward sends gradients back along the same routes."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
        stats: CommStats | None,
        name: str,
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.stats, ctx.name = (out_splits, in_splits), group, stats, name
        return all_to_all(x, out_splits, in_splits, group, stats, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        g = all_to_all(grad, in_splits, out_splits, ctx.group, ctx.stats, ctx.name + ".backward")
        return g, None, None, None, None, None


def all_gather_rows(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    stats: CommStats | None = None,
    name: str = "all_gather",
) -> torch.Tensor:
    """[n, *] on every rank -> [W*n, *], rank p's rows at block p (no autograd)."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    if stats is not None:
        nbytes = x.numel() * x.element_size() * (world - 1)
        stats.add(name, nbytes, nbytes)
    return torch.cat(parts)


class LocalSlice(torch.autograd.Function):
    """This rank's row block of a tensor every rank computed; backward all-gathers gradients."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None, name: str
    ) -> torch.Tensor:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        n = x.shape[0] // world
        ctx.group, ctx.stats, ctx.name = group, stats, name
        return x[rank * n : (rank + 1) * n].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return all_gather_rows(grad, ctx.group, ctx.stats, ctx.name + ".backward"), None, None, None


class ScaleGrad(torch.autograd.Function):
    """y = x; dL/dx = scale * dL/dy."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return grad * ctx.scale, None


def any_rank(flag: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """True on every rank if `flag` is True on any rank (lets all ranks fail together)."""
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
