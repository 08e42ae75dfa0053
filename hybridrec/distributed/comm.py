"""Collectives with explicit process groups and byte accounting; nothing here knows about
models or tables. Shapes are per rank; W = world size.

- all_to_all: x [sum(in_splits), *] -> y [sum(out_splits), *]; row block q of x goes to rank
  q, row block p of y came from rank p. Uses all_to_all_single (gloo rejects list-form
  all_to_all with unequal sizes). Its mirror (the backward of an exchange) is the same call
  with the splits swapped; hybridrec.sparse.dist.output wraps both directions, and the other
  backward collectives, in one autograd Function so their order is fixed on every rank.
- all_gather_rows / all_reduce_sum: replicated tables' row gradients, sparse or dense.
- ScaleGrad: identity forward, gradient times a constant (the 1/W of the gradient-scaling
  convention, see hybridrec.builder).
- any_rank: a boolean OR over ranks, so all ranks can fail together instead of hanging.

Each runs under its exchange name in hybridrec.distributed.failure.exchange: a peer that
does not arrive or goes away raises CollectiveError naming the exchange, step and ranks.

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

from hybridrec.distributed.failure import exchange


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


def world_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group`; None is one process with no process group (nothing to exchange)."""
    return 1 if group is None else dist.get_world_size(group)


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def all_to_all(
    x: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    name: str = "all_to_all",
) -> torch.Tensor:
    """Plain (no autograd) all_to_all_single with uneven row splits along dim 0.

    On a one-rank group the exchange is the identity: `x` itself comes back, no copy (callers
    never write into what they receive)."""
    if world_size(group) == 1:
        return x
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with exchange(name, group):
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
    if stats is not None:
        rank, rb = dist.get_rank(group), _row_bytes(x)
        stats.add(
            name, (sum(in_splits) - in_splits[rank]) * rb, (sum(out_splits) - out_splits[rank]) * rb
        )
    return out


class ScaleGrad(torch.autograd.Function):
    """y = x; dL/dx = scale * dL/dy."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return grad * ctx.scale, None


def all_gather_rows(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    name: str = "all_gather",
) -> torch.Tensor:
    """[n, *] on every rank (same n) -> [W * n, *], rank p's rows at block p (`x` itself on
    a one-rank group)."""
    world = world_size(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    with exchange(name, group):
        dist.all_gather(parts, x.contiguous(), group=group)
    if stats is not None:
        nbytes = (world - 1) * x.numel() * x.element_size()
        stats.add(name, nbytes, nbytes)
    return torch.cat(parts)


def all_reduce_sum(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    name: str = "all_reduce",
) -> torch.Tensor:
    """In-place sum over ranks. Counted as a ring all-reduce moves data: 2 (W-1)/W x bytes
    sent and received per rank. Nothing to do on a one-rank group."""
    if world_size(group) == 1:
        return x
    with exchange(name, group):
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    if stats is not None:
        world = dist.get_world_size(group)
        nbytes = 2 * (world - 1) * x.numel() * x.element_size() / world
        stats.add(name, nbytes, nbytes)
    return x


def any_rank(
    flag: bool, group: dist.ProcessGroup | None, device: torch.device, name: str = "any_rank"
) -> bool:
    """True on every rank if `flag` is True on any rank (lets all ranks fail together)."""
    if world_size(group) == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)
    with exchange(name, group):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
