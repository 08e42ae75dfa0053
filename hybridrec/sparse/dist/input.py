"""Input dist: this rank's ids [B_l, H] -> one LookupInput over the global batch per local unit.

One all_to_all_single of int32 (int64 if a table has more than 2**31 - 1 rows). Each rank
sends the owner of each unit its samples' ids for that unit's table: all of them for table-
and column-wise units of a fixed hotness; for *counted* units (row-wise: only the ids inside
the unit's row range, shifted to the shard; jagged: only the real ids) the ids plus one
count per sample, after a small all-to-all of the payload sizes.
Receivers concatenate in source-rank order, which is global-sample order, so bags number the
global batch B = W * B_l.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridrec.distributed.comm import CommStats, all_to_all
from hybridrec.sparse.bags import pooling_scale, regular_bags
from hybridrec.sparse.fused import LookupInput
from hybridrec.sparse.layout import ShardedLayout


def input_dist(
    ids: torch.Tensor,
    layout: ShardedLayout,
    group: dist.ProcessGroup,
    stats: CommStats | None,
) -> list[LookupInput]:
    """ids [B_l, H] (checked) -> a LookupInput per local unit, over the global batch."""
    b_local, world, offsets = ids.shape[0], layout.world, layout.offsets
    chunks = []
    for q in range(world):
        static, dynamic = [], []
        for u in layout.units_on[q]:
            cols = ids[:, offsets[u.table_index] : offsets[u.table_index + 1]]
            if u.row_wise:  # (PAD_ID < row_start: a jagged bag's padding is never inside)
                inside = (cols >= u.shard.row_start) & (cols < u.shard.row_end)
                static.append(inside.sum(1))
                dynamic.append(cols[inside] - u.shard.row_start)
            elif u.table.jagged:
                present = cols >= 0
                static.append(present.sum(1))
                dynamic.append(cols[present])
            else:
                static.append(cols.reshape(-1))
        chunks.append(torch.cat(static + dynamic) if static else ids.new_empty(0))
    in_splits = [c.numel() for c in chunks]
    static_sizes = [b_local if u.counted else b_local * u.table.hotness for u in layout.local_units]
    if layout.has_counted:
        counts = torch.tensor(in_splits, dtype=torch.int64, device=ids.device)
        ones = [1] * world
        out_splits = all_to_all(counts, ones, ones, group, stats, "input_dist.counts").tolist()
    else:
        out_splits = [sum(static_sizes)] * world
    recv = all_to_all(
        torch.cat(chunks).to(layout.id_dtype), out_splits, in_splits, group, stats, "input_dist"
    )
    return _parse_ids(recv.long(), out_splits, static_sizes, b_local, layout)


def _parse_ids(
    recv: torch.Tensor,
    out_splits: list[int],
    static_sizes: list[int],
    b_local: int,
    layout: ShardedLayout,
) -> list[LookupInput]:
    """The received ids, per source rank [static part | counted units' ids], -> per unit."""
    n_static = sum(static_sizes)
    units = layout.local_units
    per_unit: list[list[torch.Tensor]] = [[] for _ in units]
    lengths: list[list[torch.Tensor]] = [[] for _ in units]
    rw = [k for k, u in enumerate(units) if u.counted]
    for chunk in torch.split(recv, out_splits):
        parts = torch.split(chunk[:n_static], static_sizes)
        for k, part in enumerate(parts):
            (lengths if k in rw else per_unit)[k].append(part)
        if rw:
            sizes = torch.stack([parts[k].sum() for k in rw]).tolist()
            for k, part in zip(rw, torch.split(chunk[n_static:], sizes), strict=True):
                per_unit[k].append(part)
    batch = b_local * layout.world
    inputs = []
    for k, u in enumerate(units):
        unit_ids = torch.cat(per_unit[k])
        if u.counted:
            bags = torch.repeat_interleave(
                torch.arange(batch, device=recv.device), torch.cat(lengths[k])
            )
        else:
            bags = regular_bags(batch, u.table.hotness, recv.device)
        inputs.append(LookupInput(unit_ids, bags, batch, pooling_scale(u.table)))
    return inputs
