"""Exact mode's update of replicated (data-parallel) tables: every replica sums each row's
gradient over the whole global batch in canonical order.

The default path (hybridrec.sparse.exchange.replicated) sums each rank's own samples first and
then adds the ranks' sums (an all-reduce, or an all-gather added in rank order): a
world-size-dependent order. Here every rank gathers every rank's ids of the group's features
and their bags' gradients (both [B_l, ...] per rank, so the gather needs no sizes) and rebuilds
the group's lookup of the whole global batch as one process would make it (features in order,
samples in global order, each sample's ids in column order: the canonical order), then updates
like any group (hybridrec.sparse.exact.update.exact_update): the same bits on every replica and
at any world size. The cost: B * (H_g ids + S_g * D values) gathered per step, instead of the
rows the ranks touched; every group's ids and gradients travel in one all-gather.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from hybridrec.distributed.comm import CommStats
from hybridrec.distributed.packed import all_gather_packed
from hybridrec.sparse.bags import bag_ids, pooling_scale
from hybridrec.sparse.exact.update import exact_update
from hybridrec.sparse.fused import FusedEmbedding, LookupInput
from hybridrec.sparse.layout import GroupKey, ShardedLayout


@torch.no_grad()
def sync_replicas_exact(
    grad: torch.Tensor,
    ids: torch.Tensor,
    layout: ShardedLayout,
    stores: Mapping[GroupKey, FusedEmbedding],
    group: dist.ProcessGroup,
    stats: CommStats | None,
) -> None:
    """grad [B_l, sum of the replicated tables' widths] of this rank's samples, ids [B_l, H]
    their ids -> the same canonical update on every replica (module docstring)."""
    columns, offsets = layout.dp_columns, layout.offsets
    keys = list(layout.dp_group_tables)
    local = []  # per group its ids and its bags' gradients, all gathered in one collective
    for key in keys:
        idx = layout.dp_group_tables[key]
        local.append(torch.cat([ids[:, offsets[i] : offsets[i + 1]] for i in idx], dim=1))
        local.append(torch.cat([grad[:, slice(*columns[i])] for i in idx], dim=1))
    gathered = all_gather_packed(local, group, stats, "dp_grads.exact")
    for n, key in enumerate(keys):
        idx, emb = layout.dp_group_tables[key], stores[key]
        all_cols, all_grads = gathered[2 * n], gathered[2 * n + 1]
        batch = all_cols.shape[0]
        inputs, per_bag = [], []
        at_col = at_grad = 0
        for i in idx:
            t = layout.tables[i]
            rows, bags = bag_ids(all_cols[:, at_col : at_col + t.hotness], t)
            inputs.append(LookupInput(rows, bags, batch * t.slots, pooling_scale(t)))
            width = t.slots * t.dim
            per_bag.append(all_grads[:, at_grad : at_grad + width].reshape(-1, t.dim))
            at_col, at_grad = at_col + t.hotness, at_grad + width
        rows, bags, scale, _ = emb.flatten(inputs)
        exact_update(emb, rows, bags, scale, torch.cat(per_bag))
