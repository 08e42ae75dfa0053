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
rows the ranks touched; hybridrec.exact gathers every group's ids and gradients in the
dense partial gradients' collective.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hybridrec.sparse.bags import bag_ids, pooling_scale
from hybridrec.sparse.exact.update import exact_update
from hybridrec.sparse.fused import FusedEmbedding, LookupInput
from hybridrec.sparse.layout import GroupKey, ShardedLayout


def replica_inputs(
    grad: torch.Tensor, ids: torch.Tensor, layout: ShardedLayout
) -> list[torch.Tensor]:
    """grad [B_l, sum of the replicated tables' widths] of this rank's samples, ids [B_l, H]
    their ids -> per replicated group (layout.dp_group_tables' order) its ids [B_l, H_g] and its
    bags' gradients [B_l, W_g]: what every rank gathers (`update_replicas` takes them
    gathered, [B, ...], in rank order)."""
    columns, offsets = layout.dp_columns, layout.offsets
    local = []
    for idx in layout.dp_group_tables.values():
        local.append(torch.cat([ids[:, offsets[i] : offsets[i + 1]] for i in idx], dim=1))
        local.append(torch.cat([grad[:, slice(*columns[i])] for i in idx], dim=1))
    return local


@torch.no_grad()
def update_replicas(
    gathered: list[torch.Tensor],
    layout: ShardedLayout,
    stores: Mapping[GroupKey, FusedEmbedding],
) -> None:
    """`replica_inputs` of every rank, gathered in rank order ([B, ...] each) -> the same
    canonical update on every replica (module docstring)."""
    for n, (key, idx) in enumerate(layout.dp_group_tables.items()):
        emb = stores[key]
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
