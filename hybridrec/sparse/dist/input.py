"""Input dist: this rank's ids [B_l, H] -> one GroupInput per local fused group, over the
global batch, and what this rank needs to read its samples' pooled rows when they come back.

Wire: one all_to_all_single of int32 (int64 if a table has more than 2**31 - 1 rows). The
chunk rank r sends rank q is [counts | ids]: one count per sample for each *counted* unit of
q (row-wise: its ids inside the unit's row range, shifted to the shard; jagged: the real ids),
then every unit's ids in q's unit order (a fixed-hotness unit: all its B_l * h ids). With
counted units, a small all-to-all of the payload sizes goes first.

Routing without a loop over units: the counted features' ids all go through one bucketize
over their *id groups* (row ranges: a row-wise shard, or the whole table of a jagged feature,
which its column units share), one stable sort by id group (each group's ids stay in sample
order) and one bincount (the counts).

Lookups in send order: the receiver numbers a group's bags (source rank p, unit k of the
group, sample b), the order the ids arrive in, so a group's rows are the received ids with
the counts taken out, and its pooled output is already laid out as the output dist sends it:
no split, cat or copy per unit in either pass. Row-wise units are *compact*: a sample with no
id in the shard has no bag there (its partial sum is zero: neither computed nor sent); its
owner knows which samples from its own counts (`Routed.kept`). Receivers concatenate in
source-rank order, which is global-sample order.

Legend: W ranks, B_l samples per rank, U units, G id groups, C id columns of counted features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrec.distributed.comm import CommStats, all_to_all
from hybridrec.sparse.bags import pooling_scale
from hybridrec.sparse.layout import ShardedLayout


@dataclass(frozen=True)
class GroupInput:
    """One fused group's lookup in a step: group rows [N] (slot offset + shard id), bags [N]
    non-decreasing and numbered (source rank, unit, sample), per-id scale [N] or None, and
    per source rank the bags (pooled rows to send back) that are its samples'."""

    rows: torch.Tensor
    bags: torch.Tensor
    scale: torch.Tensor | None
    num_bags: int
    per_rank: list[int]


@dataclass(frozen=True)
class Routed:
    """A step's input dist: this rank's group lookups, and for the pooled rows coming back,
    per rank q and unit of q how many rows are this rank's samples' (`recv_rows`) and, for
    compact units (by position in the received list), which samples they are (`kept`)."""

    groups: dict[str, GroupInput]
    recv_rows: list[list[int]]
    kept: dict[int, torch.Tensor]


@dataclass(frozen=True)
class Routes:
    """The input dist's index structures, from the layout (built once, see `build_routes`).

    Sender side: `cols` [C] the counted features' id columns; `col_base` [C] each column's
    feature offset (features' rows laid end to end); `starts` [G] each id group's first row
    in that numbering; `unit_group[q][k]` the id group of rank q's unit k (-1: fixed hotness,
    sent whole from columns `unit_cols[q][k]`). Receiver side, per local unit k: `hotness[k]`
    (0: counted), `counted` (the counted local units, in order), `compact[k]`, its slot's
    first row in its group `row_base[k]`, its pooling scale `scale[k]`; `groups`: group key ->
    its local units [k0, k1)."""

    cols: torch.Tensor
    col_base: torch.Tensor
    starts: torch.Tensor
    compact_groups: list[int]
    unit_group: list[list[int]]
    unit_cols: list[list[tuple[int, int]]]
    hotness: list[int]
    counted: list[int]
    compact: list[bool]
    row_base: list[int]
    scale: list[float]
    groups: dict[str, tuple[int, int]]


def build_routes(layout: ShardedLayout, device: torch.device) -> Routes:
    """The Routes of this layout (pure)."""
    plan, offsets = layout.plan, layout.offsets
    starts, cols, col_base = [], [], []
    group_of: dict[tuple[int, int], int] = {}  # (feature, shard row_start) -> id group
    compact_groups = []
    base = 0
    for f, t in enumerate(layout.tables):
        tp = plan.tables[layout.storage_of[f]]
        row_wise = tp.sharding.value == "row_wise"
        if f in layout.dp_tables or not (row_wise or t.jagged):
            continue
        ranges = sorted({s.row_start for s in tp.shards}) if row_wise else [0]
        for row_start in ranges:
            group_of[(f, row_start)] = len(starts)
            if row_wise:
                compact_groups.append(len(starts))
            starts.append(base + row_start)
        cols.extend(range(offsets[f], offsets[f + 1]))
        col_base.extend([base] * t.hotness)
        base += t.num_rows
    unit_group, unit_cols = [], []
    for units in layout.units_on:
        unit_group.append(
            [
                group_of[(u.table_index, u.shard.row_start if u.row_wise else 0)]
                if u.counted
                else -1
                for u in units
            ]
        )
        unit_cols.append([(offsets[u.table_index], offsets[u.table_index + 1]) for u in units])
    local = layout.local_units
    row_base = [0] * len(local)
    groups = {}
    for key, ks in layout.group_units.items():
        slot_rows = layout.slot_rows(key)
        for k, pos in zip(ks, layout.input_slots(key), strict=True):
            row_base[k] = slot_rows[pos]
        assert ks == list(range(ks[0], ks[-1] + 1)), "a group's units lie side by side"
        groups[key] = (ks[0], ks[-1] + 1)

    def tensor(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=device)

    return Routes(
        cols=tensor(cols),
        col_base=tensor(col_base),
        starts=tensor(starts),
        compact_groups=compact_groups,
        unit_group=unit_group,
        unit_cols=unit_cols,
        hotness=[0 if u.counted else u.table.hotness for u in local],
        counted=[k for k, u in enumerate(local) if u.counted],
        compact=[u.row_wise for u in local],
        row_base=row_base,
        scale=[pooling_scale(u.table) for u in local],
        groups=groups,
    )


def _bucket(
    ids: torch.Tensor, routes: Routes
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[int]]:
    """The counted features' ids by id group, in one pass: (counts [G, B_l], each group's ids
    [n_g] shifted to its range, in sample order; each compact group's samples with an id,
    and how many)."""
    b_local, n_groups = ids.shape[0], routes.starts.numel()
    if n_groups == 0:
        return ids.new_zeros(0, b_local), [], [], []
    sel = ids.index_select(1, routes.cols)  # [B_l, C]
    shifted = sel + routes.col_base
    group = torch.bucketize(shifted, routes.starts, right=True) - 1
    group = torch.where(sel >= 0, group, n_groups).reshape(-1)  # PAD_ID: none (sorted last)
    sample = torch.arange(b_local, device=ids.device).repeat_interleave(sel.shape[1])
    counts = torch.bincount(group * b_local + sample, minlength=(n_groups + 1) * b_local)
    counts = counts[: n_groups * b_local].view(n_groups, b_local)
    present = counts[routes.compact_groups] > 0  # [G_c, B_l]
    sizes = torch.cat([counts.sum(1), present.sum(1)]).tolist()
    n_ids = sum(sizes[:n_groups])
    order = torch.sort(group, stable=True).indices[:n_ids]
    in_group = group.index_select(0, order)
    local = shifted.reshape(-1).index_select(0, order) - routes.starts.index_select(0, in_group)
    kept_n = sizes[n_groups:]
    kept = list(torch.split(present.nonzero()[:, 1], kept_n)) if kept_n else []
    return counts, list(torch.split(local, sizes[:n_groups])), kept, kept_n


def input_dist(
    ids: torch.Tensor,
    layout: ShardedLayout,
    routes: Routes,
    group: dist.ProcessGroup,
    stats: CommStats | None,
) -> Routed:
    """ids [B_l, H] (checked) -> this step's Routed: the group lookups over the global batch."""
    b_local, world = ids.shape[0], layout.world
    counts, by_group, kept_samples, kept_n = _bucket(ids, routes)
    chunks, in_splits, recv_rows, kept = [], [], [], {}
    compact_index = {g: i for i, g in enumerate(routes.compact_groups)}
    position = 0  # of the unit in the list of every rank's units (the output dist's order)
    for q in range(world):
        head, body, rows_q = [], [], []
        for g, (a, b) in zip(routes.unit_group[q], routes.unit_cols[q], strict=True):
            if g < 0:
                body.append(ids[:, a:b].reshape(-1))
                rows_q.append(b_local)
            else:
                head.append(counts[g])
                body.append(by_group[g])
                if g in compact_index:
                    kept[position] = kept_samples[compact_index[g]]
                    rows_q.append(kept_n[compact_index[g]])
                else:
                    rows_q.append(b_local)
            position += 1
        chunks.extend(head + body)
        in_splits.append(sum(t.numel() for t in head + body))
        recv_rows.append(rows_q)
    local_units = len(routes.hotness)
    if layout.has_counted:
        sizes = torch.tensor(in_splits, dtype=torch.int64, device=ids.device)
        ones = [1] * world
        out_splits = all_to_all(sizes, ones, ones, group, stats, "input_dist.counts").tolist()
    else:
        out_splits = [b_local * sum(routes.hotness)] * world
    send = torch.cat(chunks) if chunks else ids.new_empty(0)
    recv = all_to_all(send.to(layout.id_dtype), out_splits, in_splits, group, stats, "input_dist")
    groups = _group_inputs(recv.long(), out_splits, b_local, world, routes) if local_units else {}
    return Routed(groups, recv_rows, kept)


def _group_inputs(
    recv: torch.Tensor, out_splits: list[int], b_local: int, world: int, routes: Routes
) -> dict[str, GroupInput]:
    """The received chunks (one per source rank: [counts | ids]) -> each group's lookup."""
    n_units, n_counted = len(routes.hotness), len(routes.counted)
    device = recv.device
    chunks = torch.split(recv, out_splits)
    head = n_counted * b_local
    # lengths [W, U, B_l]: ids per (source, unit, sample); id counts [W, U]; output rows [W, U]
    hot = torch.tensor(routes.hotness, dtype=torch.int64, device=device)
    lengths = hot.view(1, -1, 1).expand(world, n_units, b_local)
    if n_counted:
        counts = torch.stack([c[:head].view(n_counted, b_local) for c in chunks])
        lengths = lengths.clone()
        lengths[:, routes.counted] = counts
    id_counts = lengths.sum(2)
    compact = torch.tensor(routes.compact, dtype=torch.bool, device=device)
    out_rows = torch.where(compact, (lengths > 0).sum(2), b_local)
    id_list, row_list = torch.stack([id_counts, out_rows]).tolist()
    bodies = [c[head:] for c in chunks]
    out = {}
    for key, (k0, k1) in routes.groups.items():
        if len(routes.groups) == 1:
            ids = torch.cat(bodies)
        else:
            ids = torch.cat(
                [
                    body[sum(id_list[p][:k0]) : sum(id_list[p][:k1])]
                    for p, body in enumerate(bodies)
                ]
            )
        lens = lengths[:, k0:k1]
        if any(routes.compact[k0:k1]):
            lens = lens[(lens > 0) | ~compact[k0:k1].view(1, -1, 1)]
        else:
            lens = lens.reshape(-1)
        n = ids.numel()
        bags = torch.repeat_interleave(
            torch.arange(lens.numel(), device=device), lens, output_size=n
        )
        per_unit = id_counts[:, k0:k1].reshape(-1)  # ids per (source, unit)
        base = routes.row_base[k0:k1]
        if any(base):
            starts = torch.tensor(base, dtype=torch.int64, device=device).repeat(world)
            ids = ids + torch.repeat_interleave(starts, per_unit, output_size=n)
        scale = None
        if any(s != 1.0 for s in routes.scale[k0:k1]):
            s = torch.tensor(routes.scale[k0:k1], dtype=torch.float32, device=device)
            scale = torch.repeat_interleave(s.repeat(world), per_unit, output_size=n)
        per_rank = [sum(row_list[p][k0:k1]) for p in range(world)]
        out[key] = GroupInput(ids, bags, scale, lens.numel(), per_rank)
    return out
