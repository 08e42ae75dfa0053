"""Collectives with explicit process groups and byte accounting; nothing here knows about
models or tables. Shapes are per rank; W = world size.

- all_to_all: x [sum(in_splits), *] -> y [sum(out_splits), *]; row block q of x goes to rank
  q, row block p of y came from rank p. Uses all_to_all_single (gloo rejects list-form
  all_to_all with unequal sizes). Its mirror (the backward of an exchange) is the same call
  with the splits swapped; hybridrec.sparse.exchange.output wraps both directions, and the other
  backward collectives, in one autograd Function so their order is fixed on every rank.
- all_gather_rows / all_reduce_sum: replicated tables' row gradients, sparse or dense.
- ScaleGrad: identity forward, gradient times a constant (the 1/W of the gradient-scaling
  convention, see hybridrec.builder).
- any_rank: a boolean OR over ranks, so all ranks can fail together instead of hanging.

Each runs under its exchange name in hybridrec.distributed.failure.exchange: a peer that
does not arrive or goes away raises CollectiveError naming the exchange, step and ranks.
`all_reduce`, `broadcast` and `all_gather_object` are the plain collectives the trainer,
the data loader and checkpoints use; nothing in hybridrec calls torch.distributed's directly.

Why every collective goes through here: gloo runs a collective on a worker thread, which
drops its own reference to the collective's tensors just after the caller has woken up. When
that reference is the last one, the tensor's Python object dies on the worker thread, which
then needs the GIL; at interpreter exit that aborts the process ("terminate called without
an active exception", pytorch/pytorch#190489). So the CPU tensors of the last few
collectives stay referenced here (`_held`) until later collectives have run, and
`release_held` (hybridrec.distributed.env.destroy_distributed, after its barrier) lets them
go: no gloo worker ever frees a Python object.

CommStats counts the bytes each exchange moves to and from *other* ranks, so tests can hold
the planner's cost model to the bytes actually sent.
"""

from __future__ import annotations

import math
import pickle
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hybridrec.distributed.failure import exchange

# the CPU tensors of the last collectives (module docstring): a few, so gloo's workers have
# long dropped theirs when these go; on CUDA the caller's references are the tensors' only
# owners that matter (NCCL frees nothing on a Python thread's behalf here)
_held: deque[tuple[torch.Tensor, ...]] = deque(maxlen=8)


def _hold(*tensors: torch.Tensor) -> None:
    cpu = tuple(t for t in tensors if t.device.type == "cpu")
    if cpu:
        _held.append(cpu)


def release_held() -> None:
    """Drop the references kept to recent collectives' tensors (at shutdown, after a barrier)."""
    _held.clear()


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
    x = x.contiguous()
    with exchange(name, group):
        dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=group)
    _hold(out, x)
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
    x = x.contiguous()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    parts = list(out.chunk(world)) if x.shape[0] else [x.new_empty(x.shape) for _ in range(world)]
    with exchange(name, group):
        dist.all_gather(parts, x, group=group)
    _hold(x, out, *parts)
    if stats is not None:
        nbytes = (world - 1) * x.numel() * x.element_size()
        stats.add(name, nbytes, nbytes)
    return out


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
    all_reduce(x, group, dist.ReduceOp.SUM, name)
    if stats is not None:
        world = dist.get_world_size(group)
        nbytes = 2 * (world - 1) * x.numel() * x.element_size() / world
        stats.add(name, nbytes, nbytes)
    return x


def all_reduce(
    x: torch.Tensor, group: dist.ProcessGroup | None, op: Any, name: str
) -> torch.Tensor:
    """x reduced in place over ranks with `op` (a dist.ReduceOp); `x` itself on one rank."""
    if world_size(group) > 1:
        with exchange(name, group):
            dist.all_reduce(x, op=op, group=group)
        _hold(x)
    return x


def broadcast(x: torch.Tensor, src: int, group: dist.ProcessGroup | None, name: str) -> None:
    """x (in place) from global rank `src` to every rank of `group`."""
    if world_size(group) > 1:
        with exchange(name, group):
            dist.broadcast(x, src, group=group)
        _hold(x)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None, name: str) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (as dist.all_gather_object, through
    tensors this module holds: see the module docstring). Only for trusted peers: the
    ranks of one job unpickle each other's objects."""
    world = world_size(group)
    if world == 1:
        return [obj]
    # NCCL moves CUDA tensors only
    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = all_gather_rows(size, group, name=name).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    gathered = all_gather_rows(padded, group, name=name).cpu()
    return [
        pickle.loads(part[:n].numpy().tobytes())
        for part, n in zip(gathered.chunk(world), sizes, strict=True)
    ]


def any_rank(
    flag: bool, group: dist.ProcessGroup | None, device: torch.device, name: str = "any_rank"
) -> bool:
    """True on every rank if `flag` is True on any rank (lets all ranks fail together)."""
    if world_size(group) == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)
    all_reduce(t, group, dist.ReduceOp.MAX, name)
    return bool(t.item())
