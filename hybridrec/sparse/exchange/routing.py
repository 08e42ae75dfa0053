"""The input dist's routing (hybridrec.sparse.exchange.input): from the layout, once, the
index structures (`build_routes`); per step, each id's destination rank and fused group
(`bucket`) and the chunks each rank sends (`pack`).

Routing without a loop over units: the counted features' ids all go through one search over
their *id groups* (row ranges: a row-wise shard, or the whole table of a jagged feature,
which its column units share), one stable sort by id group (each group's ids stay in sample
order), and the (group, sample) pairs of the sorted ids give the counts and each group's
samples (`bucket`).

A dynamic table's ids are raw (hybridrec.sparse.dynamic): a row-wise one's id is routed as the
first row of its hash bucket (the shard owning the bucket) and sent as the raw id itself,
which its owner maps to a row before the lookup; table-wise and column-wise ones go whole. The
receiver leaves them unshifted and lists where they are (GroupInput.raw, by slot).

Legend: W ranks, B_l samples per rank, U units, G id groups, C id columns of counted features.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridrec.kernels.hashing import bucket_of
from hybridrec.sparse.bags import pooling_scale
from hybridrec.sparse.layout import GroupKey, ShardedLayout


@dataclass(frozen=True)
class Routes:
    """The input dist's index structures, from the layout (built once, see `build_routes`).

    Sender side: `cols` [C] the counted features' id columns; `col_base` [C] each column's
    feature offset (features' rows laid end to end); `starts` [G] each id group's first row
    in that numbering; `compact_group[g]` (a row-wise shard), `sequence_group[g]` (a
    sequence feature's: its ids come back one row each); `jagged`: some columns may hold
    PAD_ID; `positions`: per column [C] its position in its sequence feature and that
    feature's length (None without sequences); `all_cols`: `cols` is every id column in
    order (then no gather); `unit_group[q][k]` the id group of rank q's unit k (-1: fixed
    hotness, sent whole from columns `unit_cols[q][k]`).
    Receiver side, per local unit k: `hotness[k]` (0: counted), `counted` (the counted local
    units, in order), `compact[k]`, its slot's first row in its group `row_base[k]` (0 for a
    dynamic unit: its raw ids are mapped later), its slot's position in its group if it is
    dynamic `raw_slot[k]` (else -1), its pooling scale `scale[k]`, whether it is a
    sequence's `sequence[k]`; `groups`: group key -> its local units [k0, k1)."""

    cols: torch.Tensor
    col_base: torch.Tensor
    starts: torch.Tensor
    compact_group: list[bool]
    sequence_group: list[bool]
    jagged: bool
    unit_group: list[list[int]]
    unit_cols: list[list[tuple[int, int]]]
    hotness: list[int]
    counted: list[int]
    compact: list[bool]
    row_base: list[int]
    raw_slot: list[int]
    scale: list[float]
    sequence: list[bool]
    groups: dict[GroupKey, tuple[int, int]]
    dynamic: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    positions: tuple[torch.Tensor, torch.Tensor] | None = None
    all_cols: bool = False  # every feature counted (row-wise, jagged, sequences): no gather


def build_routes(layout: ShardedLayout, device: torch.device, rows_per_id: bool = False) -> Routes:
    """The Routes of this layout (pure). `rows_per_id`: a row-wise feature's ids come back a
    row each, as a sequence's, unscaled (exact mode pools them where their samples are, in
    column order: hybridrec.sparse.exact.exchange), instead of partial sums."""
    plan, offsets = layout.plan, layout.offsets
    starts, cols, col_base = [], [], []
    group_of: dict[tuple[int, int], int] = {}  # (feature, shard row_start) -> id group
    compact_group, sequence_group, jagged = [], [], False
    dyn_cols: list[tuple[bool, int, int]] = []  # per counted column: dynamic, S, buckets
    seq_cols: list[tuple[int, int]] = []  # per counted column: position, sequence length
    base = 0
    for f, t in enumerate(layout.tables):
        tp = plan.tables[layout.storage_of[f]]
        row_wise = tp.sharding.traits.partial_sums
        if f in layout.dp_tables or not (row_wise or t.jagged):
            continue
        ranges = sorted({s.row_start for s in tp.shards}) if row_wise else [0]
        jagged = jagged or t.jagged
        per_id = t.sequence or (rows_per_id and row_wise)  # a row per id comes back
        for row_start in ranges:
            group_of[(f, row_start)] = len(starts)
            compact_group.append(row_wise)
            sequence_group.append(per_id)
            starts.append(base + row_start)
        cols.extend(range(offsets[f], offsets[f + 1]))
        col_base.extend([base] * t.hotness)
        d = t.dynamic
        dyn = (True, t.num_rows // d.buckets, d.buckets) if d is not None else (False, 1, 1)
        dyn_cols.extend([dyn] * t.hotness)
        seq_cols.extend((j, t.hotness if per_id else 0) for j in range(t.hotness))
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
    row_base, raw_slot = [0] * len(local), [-1] * len(local)
    groups = {}
    for key, ks in layout.group_units.items():
        slot_rows = layout.slot_rows(key)
        for k, pos in zip(ks, layout.input_slots(key), strict=True):
            if local[k].dynamic:
                raw_slot[k] = pos
            else:
                row_base[k] = slot_rows[pos]
        assert ks == list(range(ks[0], ks[-1] + 1)), "a group's units lie side by side"
        groups[key] = (ks[0], ks[-1] + 1)

    def tensor(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=device)

    return Routes(
        cols=tensor(cols),
        all_cols=cols == list(range(offsets[-1])),
        col_base=tensor(col_base),
        starts=tensor(starts),
        compact_group=compact_group,
        sequence_group=sequence_group,
        jagged=jagged,
        unit_group=unit_group,
        unit_cols=unit_cols,
        hotness=[0 if u.counted else u.table.hotness for u in local],
        counted=[k for k, u in enumerate(local) if u.counted],
        compact=[u.row_wise for u in local],
        row_base=row_base,
        raw_slot=raw_slot,
        scale=[1.0 if rows_per_id and u.row_wise else pooling_scale(u.table) for u in local],
        sequence=[u.table.sequence or (rows_per_id and u.row_wise) for u in local],
        groups=groups,
        dynamic=(
            (
                torch.tensor([d for d, _, _ in dyn_cols], dtype=torch.bool, device=device),
                tensor([s for _, s, _ in dyn_cols]),
                tensor([b for _, _, b in dyn_cols]),
            )
            if any(d for d, _, _ in dyn_cols)
            else None
        ),
        positions=(
            (tensor([j for j, _ in seq_cols]), tensor([n for _, n in seq_cols]))
            if any(sequence_group)
            else None
        ),
    )


def _searchsorted(starts: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """For each of x [N], the index of the last of `starts` (ascending) <= it (-1: none).
    On the CPU numpy's search, twice torch's there."""
    if x.device.type == "cpu":
        found = np.searchsorted(starts.numpy(), x.numpy(), side="right")
        return torch.from_numpy(found) - 1
    return torch.searchsorted(starts, x, right=True) - 1


def _stable_order(keys: torch.Tensor, n_keys: int) -> torch.Tensor:
    """The stable sort permutation of small non-negative int keys [N] (< n_keys). On the CPU
    numpy's radix sort for 16-bit keys: about 10x torch's comparison sort there."""
    if keys.device.type == "cpu" and n_keys <= 2**15:
        return torch.from_numpy(np.argsort(keys.to(torch.int16).numpy(), kind="stable"))
    return torch.sort(keys, stable=True).indices


@dataclass(frozen=True)
class Bucketed:
    """The counted features' ids of a batch by id group: counts [G, B_l] ids per sample,
    each group's ids [n_g] (shifted to its range, in sample order), each group's samples
    with at least one id [m_g] (ascending) and, for a sequence feature's group, its ids'
    positions b * L + j [n_g] (None for other groups)."""

    counts: torch.Tensor
    ids: list[torch.Tensor]
    samples: list[torch.Tensor]
    positions: list[torch.Tensor | None]


def bucket(ids: torch.Tensor, routes: Routes) -> Bucketed:
    """Route the counted features' ids [B_l, C of H] in one pass: the id group of each id
    (a search over every range), one stable sort by id group, and the (group, sample) pairs
    of the sorted ids for the counts and the samples. With jagged columns the PAD_IDs are
    dropped first (in no group; a padded sequence is mostly them): the search and the sort
    see only the real ids, in the same (sample, column) order, so the same result."""
    b_local, n_groups = ids.shape[0], routes.starts.numel()
    if n_groups == 0:
        return Bucketed(ids.new_zeros(0, b_local), [], [], [])
    # [B_l, C], ids in (sample, column) order (every column in order: ids themselves)
    sel = ids if routes.all_cols else ids.index_select(1, routes.cols)
    n_cols = sel.shape[1]
    real = None  # jagged: the real ids' flat positions b * C + c [N], and sel those ids [N]
    if routes.jagged:
        real = (sel.reshape(-1) >= 0).nonzero().squeeze(1)
        sel, real_col = sel.reshape(-1).index_select(0, real), real.remainder(n_cols)

    def column(x: torch.Tensor) -> torch.Tensor:  # a per-column value [C], for each id of sel
        return x if real is None else x.index_select(0, real_col)

    key = sel
    if routes.dynamic is not None:  # a dynamic table's raw id goes where its bucket lives
        is_dyn, size, buckets = (column(x) for x in routes.dynamic)
        pseudo = bucket_of(sel, buckets) * size  # its bucket's first row
        key = torch.where(is_dyn & (sel >= 0), pseudo, sel)
    shifted = (key + column(routes.col_base)).reshape(-1)
    group = _searchsorted(routes.starts, shifted)
    sort = _stable_order(group, n_groups + 1)  # into sel's ids
    in_group = group.index_select(0, sort)
    order = sort if real is None else real.index_select(0, sort)  # flat positions b * C + c
    pair = in_group * b_local + order.div(n_cols, rounding_mode="floor")  # non-decreasing
    pairs, per_pair = torch.unique_consecutive(pair, return_counts=True)
    counts = ids.new_zeros((n_groups + 1) * b_local).index_put_((pairs,), per_pair)
    counts = counts[: n_groups * b_local].view(n_groups, b_local)
    pair_group = pairs.div(b_local, rounding_mode="floor")
    sizes = torch.cat([counts.sum(1), torch.bincount(pair_group, minlength=n_groups + 1)])
    sizes = sizes.tolist()
    n_ids, n_pairs = sum(sizes[:n_groups]), sum(sizes[n_groups : 2 * n_groups])
    order, in_group, sort = order[:n_ids], in_group[:n_ids], sort[:n_ids]
    local = shifted.index_select(0, sort) - routes.starts.index_select(0, in_group)
    if routes.dynamic is not None:  # ... carrying the raw id itself
        raw = sel.reshape(-1).index_select(0, sort)
        dyn = routes.dynamic[0].index_select(0, order.remainder(n_cols))
        local = torch.where(dyn, raw, local)
    samples = pairs[:n_pairs] - pair_group[:n_pairs] * b_local
    positions: list[torch.Tensor | None] = [None] * n_groups
    if routes.positions is not None:  # a sequence's ids: where each sits in its sequence
        at, length = routes.positions
        col = order.remainder(n_cols)
        pos = order.div(n_cols, rounding_mode="floor") * length.index_select(0, col)
        pos += at.index_select(0, col)
        for g, p in enumerate(torch.split(pos, sizes[:n_groups])):
            positions[g] = p if routes.sequence_group[g] else None
    return Bucketed(
        counts,
        list(torch.split(local, sizes[:n_groups])),
        list(torch.split(samples, sizes[n_groups : 2 * n_groups])),
        positions,
    )


@dataclass(frozen=True)
class Packed:
    """What one rank sends in the input dist: the chunks (rank by rank: flag, counts, ids),
    each rank's share of them, and for the output dist (see Receipt) recv_rows and kept."""

    chunks: list[torch.Tensor]
    in_splits: list[int]
    recv_rows: list[list[int]]
    kept: dict[int, torch.Tensor]


def pack(ids: torch.Tensor, routes: Routes, flag: bool = False) -> Packed:
    """ids [B_l, H] (checked; `flag`: some were out of range, now 0) -> the send side."""
    b_local = ids.shape[0]
    bucketed = bucket(ids, routes)
    chunks, in_splits, recv_rows, kept = [], [], [], {}
    position = 0  # of the unit in the list of every rank's units (the output dist's order)
    flag_t = ids.new_full((1,), int(flag))
    for groups, cols in zip(routes.unit_group, routes.unit_cols, strict=True):
        head, body, rows_q = [flag_t], [], []
        for g, (a, b) in zip(groups, cols, strict=True):
            if g < 0:
                body.append(ids[:, a:b].reshape(-1))
                rows_q.append(b_local)
            else:
                head.append(bucketed.counts[g])
                body.append(bucketed.ids[g])
                at = bucketed.positions[g]
                if at is not None:  # a sequence's ids come back a row each
                    kept[position] = at
                    rows_q.append(at.numel())
                elif routes.compact_group[g]:
                    kept[position] = bucketed.samples[g]
                    rows_q.append(bucketed.samples[g].numel())
                else:
                    rows_q.append(b_local)
            position += 1
        chunks.extend(head + body)
        in_splits.append(sum(t.numel() for t in head + body))
        recv_rows.append(rows_q)
    return Packed(chunks, in_splits, recv_rows, kept)
