"""Row statistics shared between column shards (row-wise Adagrad).

Row-wise Adagrad keeps one statistic per row, mean(g^2) over the row's full width, but a
column shard sees only its columns. The owners of a table's column shards hold the same
unique rows in the same order (they receive the same ids), so each sends the others its
per-row partial sums of g^2 (one all-to-all, in the output dist's backward) and every owner
adds them in shard order, the same sum everywhere: exactly the unsharded table's statistic.

The result travels explicitly: `RowStats` is made per step by the forward, handed to the
groups' lookups and filled here before their backward (which autograd runs after this one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridrec.distributed.comm import CommStats, all_to_all
from hybridrec.kernels.segment import dedupe
from hybridrec.sparse.fused import LookupInput
from hybridrec.sparse.layout import ShardedLayout


class RowStats:
    """One step's full-row mean(g^2) per group: group key -> {shard index: [U_u]}."""

    def __init__(self) -> None:
        self.by_group: dict[str, dict[int, torch.Tensor]] = {}

    def take(self, key: str) -> dict[int, torch.Tensor] | None:
        """The group's statistics, once (None: the group has no shared rows this step)."""
        return self.by_group.pop(key, None)


def share_row_stats(
    grad: torch.Tensor,
    b_local: int,
    inputs: list[LookupInput],
    layout: ShardedLayout,
    group: dist.ProcessGroup,
    stats: CommStats | None,
    out: RowStats,
) -> None:
    """grad [W * B_l * width_on[rank]]: the gradients of this rank's units, as sent back;
    `inputs`: this step's LookupInput per local unit. Fills `out` for the column units."""
    world, peers, units = layout.world, layout.peers, layout.local_units
    per_rank = grad.view(world, -1)  # row p: rank p's samples, units side by side
    partial: dict[int, torch.Tensor] = {}
    col = 0
    for k, u in enumerate(units):
        width = u.shard.width * b_local
        if k in peers:
            g_unit = per_rank[:, col : col + width].reshape(world * b_local, u.shard.width)
            inp = inputs[k]
            _, g_rows = dedupe(inp.ids, inp.bags, inp.scale, g_unit)
            partial[k] = g_rows.pow(2).sum(dim=1)
        col += width
    sends = [[partial[k] for k in partial if q in peers[k]] for q in range(world)]
    in_splits = [sum(p.numel() for p in parts) for parts in sends]
    out_splits = [sum(partial[k].numel() for k in partial if q in peers[k]) for q in range(world)]
    flat = [p for parts in sends for p in parts]
    flat_t = torch.cat(flat) if flat else grad.new_zeros(0)
    recv = all_to_all(flat_t, out_splits, in_splits, group, stats, "row_stats")
    received: dict[tuple[int, int], torch.Tensor] = {}
    for q, chunk in enumerate(torch.split(recv, out_splits)):
        ks = [k for k in partial if q in peers[k]]
        sizes = [partial[k].numel() for k in ks]
        for k, part in zip(ks, torch.split(chunk, sizes), strict=True):
            received[(k, q)] = part
    slot = {k: (key, pos) for key, ks in layout.group_units.items() for pos, k in enumerate(ks)}
    for k in partial:
        u = units[k]
        total = None
        for s in layout.plan.tables[u.table_index].shards:  # shard order: the same sum everywhere
            part = partial[k] if s.rank == layout.rank else received[(k, s.rank)]
            total = part if total is None else total + part
        key, pos = slot[k]
        out.by_group.setdefault(key, {})[pos] = total / u.table.dim
