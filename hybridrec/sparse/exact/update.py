"""Exact mode's row updates: each row's gradient summed in one canonical order, at any world size.

The canonical order of a row's gradient terms (one per id that looked it up) is (feature,
global sample, position in the sample's ids). The dedupe kernels (hybridrec.kernels.segment)
add a row's terms in the order the ids come, from 0, so the order the ids come in is what
needs fixing, and only for a slot several features read (a shared table): the ids of one
feature come in global-sample order from every exchange (the all-to-all's (source rank, unit,
sample) numbering: ranks in order hold consecutive samples; the sample-major numbering). A
stable sort by feature (`canonical_order`) makes a shared slot's ids canonical.

Optimizers reading mean(g^2) over a row's full width (row-wise Adagrad) get it from
`full_row_stats` for every row: the seen gradient (with L2 decay g + wd * w) squared and added
over the columns by hybridrec.distributed.exact_sum.fold_columns' fixed tree, then divided by
the width; column shards get the same fold over the whole row from their peers
(hybridrec.sparse.exact.row_stats). The default path's torch mean differs in its order.

`ExactLookup` is the fused group's lookup with that backward: one update per step, as the
default path's (hybridrec.sparse.fused._GroupLookup), in canonical order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridrec import timing
from hybridrec.distributed.exact_sum import fold_columns
from hybridrec.kernels.segment import dedupe
from hybridrec.sparse.fused import FusedEmbedding, RowSq, RowSqSource
from hybridrec.sparse.layout import GroupKey, ShardedLayout
from hybridrec.sparse.step import GroupInput


def shared_groups(layout: ShardedLayout) -> dict[GroupKey, torch.Tensor]:
    """Groups with a slot that several of its units read -> the feature of each unit
    [U_g] (int64): the groups whose ids `canonical_order` sorts."""
    out = {}
    for key, ks in layout.group_units.items():
        slots = layout.input_slots(key)
        if len(set(slots)) < len(slots):
            features = [layout.local_units[k].table_index for k in ks]
            out[key] = torch.tensor(features, dtype=torch.int64)
    return out


def sample_major_features(tables: Sequence[Any]) -> torch.Tensor:
    """Per output row of a sample-major lookup (bag % S), its feature [S] (int64)."""
    rows = [t.slots for t in tables]
    return torch.repeat_interleave(torch.arange(len(tables)), torch.tensor(rows))


def canonical_order(
    inp: GroupInput, unit_features: torch.Tensor, slot_features: torch.Tensor
) -> torch.Tensor:
    """The permutation [N] putting a group's ids in canonical order: stable by feature.
    `unit_features` [U_g]: each unit's feature (the all-to-all's numbering, read through
    inp.per_unit); `slot_features` [S]: each output row's (the sample-major numbering)."""
    device = inp.bags.device
    if inp.per_unit is None:  # sample-major: bag = b * S + output row
        feature = slot_features.to(device).index_select(0, inp.bags % slot_features.numel())
    else:  # bags numbered (source rank, unit, ...): blocks of per_unit[p][k] bags
        sizes = torch.tensor([n for rows in inp.per_unit for n in rows], device=device)
        units = unit_features.to(device).repeat(len(inp.per_unit))
        feature = torch.repeat_interleave(units, sizes, output_size=inp.num_bags)
        feature = feature.index_select(0, inp.bags)
    return torch.sort(feature, stable=True).indices


def full_row_stats(
    store: FusedEmbedding, unique_rows: torch.Tensor, grads: torch.Tensor, given: RowSq | None
) -> RowSq:
    """Per slot of `store`, mean(g^2) over the full width of its rows among `unique_rows`
    [U] (sorted) with their gradients [U, D]: `given`'s for column slots (their peers' columns
    included), else this row's own, by the canonical fold (module docstring)."""
    seen = store.seen_grads(unique_rows, grads)
    stat = fold_columns(seen * seen) / seen.shape[1]
    bounds = torch.searchsorted(unique_rows, store.row_offsets).tolist()
    given = given or {}
    return {
        u: given[u] if u in given else stat[bounds[u] : bounds[u + 1]]
        for u in range(len(store.shards))
    }


@torch.no_grad()
def exact_update(
    store: FusedEmbedding,
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | None,
    grad_pooled: torch.Tensor,
    column_stats: RowSq | None = None,
) -> None:
    """One optimizer step of `store`'s rows from ids in canonical order (rows, bags, scale
    [N]) and their bags' gradients [num_bags, D]: each row's terms added in that order."""
    with timing.phase("sparse_update"):
        assert store.optimizer is not None
        if not store.optimizer.needs_full_row_stat:
            store.apply_gradient(rows, bags, scale, grad_pooled)
            return
        unique_rows, grads = dedupe(rows, bags, scale, grad_pooled)
        stats = full_row_stats(store, unique_rows, grads, column_stats)
        store.update_rows(unique_rows, grads, row_sq=stats)


class ExactLookup(torch.autograd.Function):
    """pooled[bag] = sum_i scale_i * weight[row_i] as the group's own lookup (the same
    pooling); backward: `exact_update` with the ids in canonical order (`order`, None: as
    they are) and the column slots' full-row statistics (`row_sq`, asked in the backward)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        anchor: torch.Tensor,
        store: FusedEmbedding,
        rows: torch.Tensor,
        bags: torch.Tensor,
        scale: torch.Tensor | None,
        num_bags: int,
        row_sq: RowSqSource | None,
        prefetched: Any,
        order: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.store, ctx.row_sq = store, row_sq
        ctx.save_for_backward(rows, bags, scale, order)
        pooled, _ = store.pool(rows, bags, scale, num_bags, torch.float32, prefetched, True)
        return pooled

    @staticmethod
    def backward(ctx: Any, grad_pooled: torch.Tensor) -> tuple:  # type: ignore[override]
        rows, bags, scale, order = ctx.saved_tensors
        if order is not None:
            rows, bags = rows.index_select(0, order), bags.index_select(0, order)
            scale = scale.index_select(0, order) if scale is not None else None
        stats = ctx.row_sq() if ctx.row_sq is not None else None
        exact_update(ctx.store, rows, bags, scale, grad_pooled.float(), stats)
        return (torch.zeros(0, device=grad_pooled.device), *(None,) * 8)
