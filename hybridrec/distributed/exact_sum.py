"""Sums whose order is fixed by their operands' count alone, never by how many ranks hold them.

Exact mode (hybridrec.exact, docs/exact.md) adds every quantity summed over samples in one
canonical order, so that any world size gives the bits one process gives:

- `tree_sum(parts)`: a fixed pairwise tree over a list (leaves paired left to right, an odd
  one carried up): what micro-shards' partial gradients are added by.
- `fold_columns(x)`: the same tree over the columns of [U, D], per row (a row-wise statistic
  over a row's full width, whichever ranks hold its columns).
- `tree_sum_rows(x)`: `tree_sum(list(x))` of [M, P] with one vectorised add per tree level.
- `exact_all_reduce(parts, group)`: every rank's micro-shards' partial sums [M_l, P] -> the
  tree sum over all M = W * M_l micro-shards [P], the same bits on every rank and at every
  world size that divides M. Each element is summed by `tree_sum` over the M micro-shards in
  their global order, so how elements are split into chunks, or micro-shards over ranks,
  cannot change a bit: elementwise float additions are correctly rounded.

How `exact_all_reduce` moves data, one of two ways (the same bits either way, so the choice
may depend on sizes): when all M partials together are small (M * P <= `GATHER_BELOW`
values, 4 MiB: every dense part of the repository's models), one all-gather hands every rank
all of them ([M, P]) and each rank adds them by the tree: one collective (on CPU/gloo a
collective's fixed cost outweighs the bytes at these sizes), (W-1) * M_l * P values received
per rank, M * P held. Larger, an all-to-all gives rank q every micro-shard's chunk q of the
vector ([M, P/W]: a reduce-scatter that keeps the operands apart instead of adding them in
arrival order), each rank adds its chunk by the tree, and an all-gather returns the chunks
([P]). Per rank it sends (W-1)/W * M_l * P and (W-1)/W * P values and holds M * P / W of the
operands at once: with one micro-shard per rank (M = W) exactly the bytes of a ring
all-reduce, and M_l times its first half in general.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybridrec.distributed.comm import CommStats, all_gather_rows, all_to_all, world_size


def tree_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of `parts` (tensors of one shape, at least one) by a fixed pairwise tree:
    level by level, parts 2i and 2i+1 added, an odd last part carried up as it is."""
    level = list(parts)
    if not level:
        raise ValueError("tree_sum needs at least one part")
    while len(level) > 1:
        pairs = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        level = pairs + level[-1:] if len(level) % 2 else pairs
    return level[0]


def tree_sum_rows(x: torch.Tensor) -> torch.Tensor:
    """[M, P] (M >= 1) -> [P]: `tree_sum(list(x))`, bit for bit (the same pairs at every
    level), each level one vectorised add of its even rows and odd rows."""
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"tree_sum_rows takes [M, P] with M >= 1, got {list(x.shape)}")
    while x.shape[0] > 1:
        even = x.shape[0] // 2 * 2
        pairs = x[0:even:2] + x[1:even:2]
        x = torch.cat([pairs, x[even:]]) if even < x.shape[0] else pairs
    return x[0]


def fold_columns(x: torch.Tensor) -> torch.Tensor:
    """[U, D] -> [U]: each row's sum over its columns by `tree_sum`'s tree (columns 2i and
    2i+1 added, an odd last column carried up), whatever U is."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"fold_columns takes [U, D] with D >= 1, got {list(x.shape)}")
    while x.shape[1] > 1:
        even = x.shape[1] // 2 * 2
        pairs = x[:, 0:even:2] + x[:, 1:even:2]
        x = torch.cat([pairs, x[:, even:]], dim=1) if even < x.shape[1] else pairs
    return x[:, 0]


GATHER_BELOW = 1 << 20  # M * P values up to which exact_all_reduce gathers every partial


def gathers_all(world: int, m_local: int, n: int, gather_below: int = GATHER_BELOW) -> bool:
    """Whether `exact_all_reduce` of [m_local, n] on `world` ranks takes its one-all-gather
    way (module docstring): the M * P partials are at most `gather_below` values."""
    return world * m_local * n <= gather_below


def exact_all_reduce(
    parts: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    name: str = "exact_all_reduce",
    gather_below: int = GATHER_BELOW,
) -> torch.Tensor:
    """parts [M_l, P]: this rank's micro-shards' partial sums, in order (rank r holds
    micro-shards r * M_l .. r * M_l + M_l - 1) -> [P], `tree_sum` over every rank's
    micro-shards in global order, on every rank (module docstring; `gather_below` picks the
    way, never the bits). A collective."""
    world = world_size(group)
    if world == 1:
        return tree_sum_rows(parts)
    m_local, n = parts.shape
    if gathers_all(world, m_local, n, gather_below):  # [M, P] in global order on every rank
        return tree_sum_rows(all_gather_rows(parts, group, stats, name))
    chunk = -(-n // world)
    padded = parts.new_zeros(m_local, world * chunk)
    padded[:, :n] = parts
    # block q (every local micro-shard's chunk q) goes to rank q
    send = padded.view(m_local, world, chunk).transpose(0, 1).reshape(world * m_local, chunk)
    splits = [m_local] * world
    recv = all_to_all(send, splits, splits, group, stats, name)  # [M, chunk], global order
    mine = tree_sum_rows(recv)
    return all_gather_rows(mine.view(1, chunk), group, stats, name).view(-1)[:n]
