"""Replicated (data-parallel) tables: every rank holds the whole table.

Forward: each rank pools its own samples, with no exchange and no autograd. Backward (called
from the output dist's backward, after its all-to-all): each rank deduplicates its rows'
gradients; then, the cheaper way for the group's size (hybridrec.sparse.costs.replica_sync,
the same choice on every rank), either a dense [rows, D + 1] all-reduce of gradient sums and
a "touched" count, or an all-gather of every rank's touched rows summed in rank order. Either
way every replica applies the reference's update to exactly the rows some rank used.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from hybridrec import timing
from hybridrec.distributed.comm import CommStats, all_gather_rows, all_reduce_sum
from hybridrec.kernels.segment import dedupe
from hybridrec.sparse.bags import bag_ids, pooling_scale
from hybridrec.sparse.costs import replica_sync
from hybridrec.sparse.fused import FusedEmbedding, LookupInput
from hybridrec.sparse.layout import GroupKey, ShardedLayout

ReplicaInputs = dict[GroupKey, list[LookupInput]]  # replicated group -> its tables' inputs


@torch.no_grad()
def replicated_lookup(
    ids: torch.Tensor, layout: ShardedLayout, stores: Mapping[GroupKey, FusedEmbedding]
) -> tuple[torch.Tensor, ReplicaInputs]:
    """ids [B_l, H] -> (this rank's samples' pooled replicated tables side by side, [B_l,
    sum of their widths] in table order (layout.dp_columns: a sequence's rows side by side),
    the inputs the backward needs)."""
    b_local, offsets = ids.shape[0], layout.offsets
    pooled: dict[int, torch.Tensor] = {}
    saved: ReplicaInputs = {}
    for key, idx in layout.dp_group_tables.items():
        inputs = []
        for i in idx:
            t = layout.tables[i]
            rows, bags = bag_ids(ids[:, offsets[i] : offsets[i + 1]], t)
            inputs.append(LookupInput(rows, bags, b_local * t.slots, pooling_scale(t)))
        saved[key] = inputs
        pooled.update(zip(idx, stores[key](inputs), strict=True))
    if not layout.dp_tables:
        return torch.zeros(b_local, 0, device=ids.device), saved
    return torch.cat([pooled[i].reshape(b_local, -1) for i in layout.dp_tables], dim=1), saved


@torch.no_grad()
def sync_replicas(
    grad: torch.Tensor,
    inputs: ReplicaInputs,
    layout: ShardedLayout,
    stores: Mapping[GroupKey, FusedEmbedding],
    group: dist.ProcessGroup,
    stats: CommStats | None,
) -> None:
    """grad [B_l, sum of widths] of this rank's samples -> the same update on every replica."""
    columns = layout.dp_columns
    b_local, world = grad.shape[0], layout.world
    for key, idx in layout.dp_group_tables.items():
        emb = stores[key]
        with timing.phase("sparse_update"):
            rows, bags, scale, _ = emb.flatten(inputs[key])
            grad_pooled = torch.cat(
                [grad[:, slice(*columns[i])].reshape(-1, emb.width) for i in idx]
            )
            unique_rows, grads = dedupe(rows, bags, scale, grad_pooled)
        ids = b_local * sum(layout.tables[i].hotness for i in idx)
        if world == 1:  # the only replica: its own rows and sums
            rows_all, grads_all = unique_rows, grads
        elif replica_sync(emb.num_rows, emb.width, ids, world)[0] == "all_reduce":
            total = torch.zeros(emb.num_rows, emb.width + 1, device=grads.device)
            total[unique_rows, : emb.width] = grads
            total[unique_rows, emb.width] = 1.0
            all_reduce_sum(total, group, stats, "dp_grads")
            touched = (total[:, emb.width] > 0).nonzero().squeeze(1)
            rows_all, grads_all = touched, total[touched, : emb.width]
        else:
            rows_all, grads_all = _gather_touched(unique_rows, grads, group, stats)
        with timing.phase("sparse_update"):
            emb.update_rows(rows_all, grads_all)


def _gather_touched(
    rows: torch.Tensor, grads: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's (rows [U_r], grads [U_r, D]) -> their union, summed in rank order."""
    counts = all_gather_rows(rows.new_tensor([rows.numel()]), group, None)
    most = int(counts.max())
    rows_pad = torch.full((most,), -1, dtype=rows.dtype, device=rows.device)
    rows_pad[: rows.numel()] = rows
    grads_pad = grads.new_zeros(most, grads.shape[1])
    grads_pad[: rows.numel()] = grads
    all_rows = all_gather_rows(rows_pad, group, stats, "dp_grads")
    all_grads = all_gather_rows(grads_pad, group, stats, "dp_grads")
    valid = all_rows >= 0
    union, inverse = torch.unique(all_rows[valid], sorted=True, return_inverse=True)
    summed = grads.new_zeros(union.numel(), grads.shape[1])
    return union, summed.index_add_(0, inverse, all_grads[valid])
