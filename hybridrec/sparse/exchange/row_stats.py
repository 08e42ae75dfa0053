"""Row statistics shared between column shards (row-wise Adagrad).

Row-wise Adagrad keeps one statistic per row, mean(g^2) over the row's full width, but a
column shard sees only its columns. The owners of a table's column shards hold the same
unique rows in the same order (they receive the same ids), so each sends the others its
per-row partial sums of g^2 (one all-to-all, in the output dist's backward) and every owner
adds them in shard order, the same sum everywhere: exactly the unsharded table's statistic.

The result travels explicitly: `RowStats` is made per step by the forward, handed to the
groups' lookups and filled here before their backward (which autograd runs after this one).

With L2 weight decay the statistic is of the gradient the maths see, g + wd * w (FBGEMM's
row-wise Adagrad adds the L2 term before it too): each owner adds its own columns' wd * w
before squaring (hybridrec.kernels.rows.seen_grads), read from its group's rows, which no
update has changed yet in this backward. Column shards live in device groups (host-resident
shards are whole-width), whose `weight` holds the rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from hybridrec.distributed.comm import CommStats, all_to_all
from hybridrec.kernels.rows import seen_grads
from hybridrec.kernels.segment import dedupe
from hybridrec.sparse.exchange.output import group_grads
from hybridrec.sparse.fused import FusedEmbedding
from hybridrec.sparse.layout import GroupKey, ShardedLayout
from hybridrec.sparse.step import StepContext


class RowStats:
    """One step's full-row mean(g^2) per group: group key -> {shard index: [U_u]}."""

    def __init__(self) -> None:
        self.by_group: dict[GroupKey, dict[int, torch.Tensor]] = {}

    def take(self, key: GroupKey) -> dict[int, torch.Tensor] | None:
        """The group's statistics, once (None: the group has no shared rows this step)."""
        return self.by_group.pop(key, None)


def column_slots(layout: ShardedLayout) -> dict[tuple[GroupKey, int], list[int]]:
    """This rank's slots of column shards, (group, slot position) -> their units, in (table,
    shard) order: the order every rank lists the same tables' shards in."""
    peers, units = layout.peers, layout.local_units
    slot_units: dict[tuple[GroupKey, int], list[int]] = {}
    for key, ks in layout.group_units.items():
        for k, pos in zip(ks, layout.input_slots(key), strict=True):
            if k in peers:
                slot_units.setdefault((key, pos), []).append(k)
    order = sorted(slot_units, key=lambda x: (units[slot_units[x][0]].slot[0], x[0], x[1]))
    return {x: slot_units[x] for x in order}


def share_row_stats(
    grad: torch.Tensor,
    step: StepContext,
    layout: ShardedLayout,
    group: dist.ProcessGroup,
    stats: CommStats | None,
    stores: Mapping[GroupKey, FusedEmbedding],
) -> None:
    """grad: the gradient of this rank's groups' pooled rows, flat as sent back (output.
    send_order); `step`: this step's context (its group lookups, and the RowStats it fills
    for the column shards); `stores`: this rank's groups' rows (their optimizer's decay, and
    the rows L2 decay adds). A shard read by several features (a shared table) takes their
    gradients together: a row's statistic is of its summed gradient."""
    world, peers, units = layout.world, layout.peers, layout.local_units
    out: RowStats = step.row_stats
    grads = group_grads(grad, step, world)
    slot_units = column_slots(layout)
    order = list(slot_units)
    partial: dict[tuple[GroupKey, int], torch.Tensor] = {}
    for key, pos in order:
        inp = step.lookups[key]
        start, end = layout.slot_rows(key)[pos : pos + 2]
        at = ((inp.rows >= start) & (inp.rows < end)).nonzero().squeeze(1)
        scale = inp.scale.index_select(0, at) if inp.scale is not None else None
        rows, bags = inp.rows.index_select(0, at), inp.bags.index_select(0, at)
        unique_rows, g_rows = dedupe(rows, bags, scale, grads[key])
        fused = stores[key]
        decay = fused.optimizer.weight_decay_for(fused.shards[pos].table)
        if decay and fused.optimizer.weight_decay_mode == "l2":
            if key.on_host:  # (the planner never puts column shards in host memory)
                raise NotImplementedError("a host-resident column shard's L2 row statistic")
            g_rows = seen_grads(fused.optimizer, fused.weight, unique_rows, g_rows, decay)
        partial[(key, pos)] = g_rows.pow(2).sum(dim=1)
    slot_peers = {slot: peers[ks[0]] for slot, ks in slot_units.items()}
    sends = [[partial[x] for x in partial if q in slot_peers[x]] for q in range(world)]
    in_splits = [sum(p.numel() for p in parts) for parts in sends]
    out_splits = [
        sum(partial[x].numel() for x in partial if q in slot_peers[x]) for q in range(world)
    ]
    flat = [p for parts in sends for p in parts]
    flat_t = torch.cat(flat) if flat else grad.new_zeros(0)
    recv = all_to_all(flat_t, out_splits, in_splits, group, stats, "row_stats")
    received: dict[tuple[tuple[GroupKey, int], int], torch.Tensor] = {}
    for q, chunk in enumerate(torch.split(recv, out_splits)):
        xs = [x for x in partial if q in slot_peers[x]]
        sizes = [partial[x].numel() for x in xs]
        for x, part in zip(xs, torch.split(chunk, sizes), strict=True):
            received[(x, q)] = part
    for x, ks in slot_units.items():
        u = units[ks[0]]
        total = None
        for s in layout.plan.tables[u.storage_index].shards:  # shard order: the same everywhere
            part = partial[x] if s.rank == layout.rank else received[(x, s.rank)]
            total = part if total is None else total + part
        key, pos = x
        out.by_group.setdefault(key, {})[pos] = total / u.table.dim
