"""Exact mode's full-row statistic of column shards (row-wise Adagrad): the same bits as the
unsharded row's.

The default path (hybridrec.sparse.exchange.row_stats) sends each peer a per-row partial sum
of g^2 over its columns and adds the partials in shard order: another order of additions than
one process's sum over the whole row. Here each owner of a table's column shards sends its
peers the seen gradient of its columns itself, [U, w] (the same unique rows, in the same order,
on every owner: they receive the same ids), every owner puts the row back together in column
order, [U, D], and takes the canonical statistic of it (hybridrec.sparse.exact.update: the
fixed tree over the columns), which is the one the unsharded row gets. The cost: U * w values
to each peer instead of U.

A slot several features read (a shared table) takes their ids in canonical order first, as its
update does, so its seen gradient is the one the update uses.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from hybridrec.distributed.comm import CommStats, all_to_all
from hybridrec.distributed.exact_sum import fold_columns
from hybridrec.kernels.segment import dedupe
from hybridrec.sparse.exact.update import canonical_order
from hybridrec.sparse.exchange.output import group_grads
from hybridrec.sparse.exchange.row_stats import RowStats, column_slots
from hybridrec.sparse.fused import FusedEmbedding
from hybridrec.sparse.layout import GroupKey, ShardedLayout
from hybridrec.sparse.step import StepContext

Slot = tuple[GroupKey, int]  # (group, slot position)


def share_seen_rows(
    grad: torch.Tensor,
    step: StepContext,
    layout: ShardedLayout,
    group: dist.ProcessGroup,
    stats: CommStats | None,
    stores: Mapping[GroupKey, FusedEmbedding],
    shared: Mapping[GroupKey, torch.Tensor],
) -> None:
    """Fill the step's RowStats with every local column slot's full-row statistic [U] (module
    docstring). grad: this rank's groups' pooled-row gradients, flat as sent back; `shared`:
    the groups whose ids are sorted into canonical order, with their units' features."""
    world, peers, units = layout.world, layout.peers, layout.local_units
    out: RowStats = step.row_stats
    grads = group_grads(grad, step, world)
    slot_units = column_slots(layout)
    order = list(slot_units)
    seen: dict[Slot, torch.Tensor] = {}
    for key, pos in order:
        inp = step.lookups[key]
        rows, bags, scale = inp.rows, inp.bags, inp.scale
        if key in shared:
            perm = canonical_order(inp, shared[key], shared[key])
            rows, bags = rows.index_select(0, perm), bags.index_select(0, perm)
            scale = scale.index_select(0, perm) if scale is not None else None
        start, end = layout.slot_rows(key)[pos : pos + 2]
        at = ((rows >= start) & (rows < end)).nonzero().squeeze(1)
        scale = scale.index_select(0, at) if scale is not None else None
        unique_rows, g_rows = dedupe(
            rows.index_select(0, at), bags.index_select(0, at), scale, grads[key]
        )
        seen[(key, pos)] = stores[key].seen_grads(unique_rows, g_rows)
    slot_peers = {slot: peers[ks[0]] for slot, ks in slot_units.items()}
    shards = {  # per slot, its table's column shards in column order
        slot: sorted(
            layout.plan.tables[units[ks[0]].storage_index].shards, key=lambda s: s.col_start
        )
        for slot, ks in slot_units.items()
    }
    sends = [[seen[x].reshape(-1) for x in order if q in slot_peers[x]] for q in range(world)]
    in_splits = [sum(p.numel() for p in parts) for parts in sends]

    def width_on(x: Slot, q: int) -> int:
        return sum(s.width for s in shards[x] if s.rank == q)

    out_splits = [
        sum(seen[x].shape[0] * width_on(x, q) for x in order if q in slot_peers[x])
        for q in range(world)
    ]
    flat = [p for parts in sends for p in parts]
    flat_t = torch.cat(flat) if flat else grad.new_zeros(0)
    recv = all_to_all(flat_t, out_splits, in_splits, group, stats, "row_stats")
    received: dict[tuple[Slot, int], torch.Tensor] = {}
    for q, chunk in enumerate(torch.split(recv, out_splits)):
        xs = [x for x in order if q in slot_peers[x]]
        sizes = [seen[x].shape[0] * width_on(x, q) for x in xs]
        for x, part in zip(xs, torch.split(chunk, sizes), strict=True):
            received[(x, q)] = part.view(seen[x].shape[0], width_on(x, q))
    for x in order:
        assert sum(s.rank == layout.rank for s in shards[x]) == 1, "one column shard per rank"
        parts = [seen[x] if s.rank == layout.rank else received[(x, s.rank)] for s in shards[x]]
        row = torch.cat(parts, dim=1)  # [U, D]: the whole row, in column order
        key, pos = x
        out.by_group.setdefault(key, {})[pos] = fold_columns(row * row) / row.shape[1]
