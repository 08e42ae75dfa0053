"""Input dist: this rank's ids [B_l, H] -> one GroupInput per local fused group, over the
global batch, and the Receipt this rank needs to read its samples' pooled rows when they come
back (hybridrec.sparse.step).

Wire: one all_to_all_single of int32 (int64 if a table has more than 2**31 - 1 rows). The
chunk rank r sends rank q is [flag | counts | ids]: whether r found an out-of-range id in
this batch (so every rank learns it from the exchange it makes anyway, and all fail in the
same step with no collective of their own), one count per sample for each *counted* unit of
q (row-wise: its ids inside the unit's row range, shifted to the shard; jagged: the real ids),
then every unit's ids in q's unit order (a fixed-hotness unit: all its B_l * h ids). With
counted units, a small all-to-all of the payload sizes goes first.

Lookups in send order: the receiver numbers a group's bags (source rank p, unit k of the
group, sample b), the order the ids arrive in, so a group's rows are the received ids with
the counts taken out, and its pooled output is already laid out as the output dist sends it:
no split, cat or copy per unit in either pass. Row-wise units are *compact*: a sample with no
id in the shard has no bag there (its partial sum is zero: neither computed nor sent); its
owner knows which samples from its own counts (`Receipt.kept`). A sequence feature's unit
(Pooling.NONE) is counted, and each of its ids is a bag of its own: the rows that come back
are one per id, and its owner keeps their positions (b * L + j, `Receipt.kept`) to put them
in place. Receivers concatenate in source-rank order, which is global-sample order.

Routing (which rank and fused group each id goes to, and the payload each rank sends):
hybridrec.sparse.exchange.routing.

Legend: W ranks, B_l samples per rank, U units, G id groups, C id columns of counted features.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridrec.distributed.comm import CommStats, all_to_all
from hybridrec.sparse.exchange.routing import Routes, pack
from hybridrec.sparse.layout import GroupKey, ShardedLayout
from hybridrec.sparse.step import GroupInput, Receipt, UnequalBatches


def input_dist(
    ids: torch.Tensor,
    layout: ShardedLayout,
    routes: Routes,
    group: dist.ProcessGroup,
    stats: CommStats | None,
    flag: bool | None = None,
    share_batch: bool = False,
) -> tuple[dict[GroupKey, GroupInput], Receipt, bool]:
    """ids [B_l, H] (checked; `flag`: this rank found out-of-range ones, now 0) -> this step's
    group lookups over the global batch, the Receipt for the pooled rows coming back, and
    whether some rank flagged a bad id. `flag` None: ids are not checked at once here (a
    deferred check, on CUDA): every flag is 0 and none is read (no host sync).
    `share_batch` (with counted units): each rank's B_l rides the sizes exchange, a second
    column, so every rank learns all of them without a collective of their own (the
    collection's check that they are equal); when they differ every rank raises
    UnequalBatches before the ids cross. Only the sizes' bytes are counted as
    "input_dist.counts"; the B_l's as "batch_sizes"."""
    b_local, world = ids.shape[0], layout.world
    packed = pack(ids, routes, bool(flag))
    in_splits = packed.in_splits
    if layout.has_counted:
        sizes = torch.tensor(in_splits, dtype=torch.int64, device=ids.device)
        ones = [1] * world
        if not share_batch:
            out_splits = all_to_all(sizes, ones, ones, group, stats, "input_dist.counts").tolist()
        else:
            sizes = torch.stack([sizes, torch.full_like(sizes, b_local)], dim=1)  # [W, 2]
            got = all_to_all(sizes, ones, ones, group, None, "input_dist.counts").tolist()
            if stats is not None:
                stats.add("input_dist.counts", 8 * (world - 1), 8 * (world - 1))
                stats.add("batch_sizes", 8 * (world - 1), 8 * (world - 1))
            out_splits = [n for n, _ in got]
            batches = [b for _, b in got]
            if len(set(batches)) > 1:
                raise UnequalBatches(batches)
    else:
        out_splits = [1 + b_local * sum(routes.hotness)] * world
    send = torch.cat(packed.chunks) if packed.chunks else ids.new_empty(0)
    recv = all_to_all(send.to(layout.id_dtype), out_splits, in_splits, group, stats, "input_dist")
    groups, flagged = group_inputs(
        recv.long(), out_splits, b_local, world, routes, read_flags=flag is not None
    )
    return groups, Receipt(packed.recv_rows, packed.kept), flagged


def group_inputs(
    recv: torch.Tensor,
    out_splits: list[int],
    b_local: int,
    world: int,
    routes: Routes,
    read_flags: bool = True,
) -> tuple[dict[GroupKey, GroupInput], bool]:
    """The received chunks (one per source rank: [flag | counts | ids]) -> each group's lookup
    (none when this rank serves no unit), and whether some rank flagged an out-of-range id
    (False without `read_flags`: fixed-hotness plans then read nothing from the device)."""
    n_units, n_counted = len(routes.hotness), len(routes.counted)
    device = recv.device
    chunks = torch.split(recv, out_splits)
    head = 1 + n_counted * b_local
    flags = torch.stack([c[0] for c in chunks])
    hotness = torch.tensor(routes.hotness, dtype=torch.int64, device=device)
    # lengths [W, U, B_l]: ids per (source, unit, sample); per (source, unit): ids, output rows
    lengths = hotness.view(1, -1, 1).expand(world, n_units, b_local)
    if n_counted:
        lengths = lengths.clone()
        lengths[:, routes.counted] = torch.stack(
            [c[1:head].view(n_counted, b_local) for c in chunks]
        )
        compact = torch.tensor(routes.compact, dtype=torch.bool, device=device)
        id_counts = lengths.sum(2)
        out_rows = torch.where(compact, (lengths > 0).sum(2), b_local)
        if any(routes.sequence):  # a row per id
            seq = torch.tensor(routes.sequence, dtype=torch.bool, device=device)
            out_rows = torch.where(seq, id_counts, out_rows)
        vals = torch.cat([id_counts.view(-1), out_rows.view(-1), flags.any().view(1).long()])
        vals = vals.tolist()  # one read of every size
        id_list = [vals[p * n_units : (p + 1) * n_units] for p in range(world)]
        rows_at = world * n_units
        row_list = [vals[rows_at + p * n_units : rows_at + (p + 1) * n_units] for p in range(world)]
        flagged = bool(vals[-1])
    else:  # every unit fixed-hotness: sizes known without reading anything
        id_list = [[b_local * h for h in routes.hotness]] * world
        row_list = [[b_local] * n_units] * world
        flagged = read_flags and bool(flags.any())
    bodies = [c[head:] for c in chunks]
    out = {}
    for key, (k0, k1) in routes.groups.items():
        if len(routes.groups) == 1:
            ids = torch.cat(bodies)
        else:
            ids = torch.cat(
                [body[sum(id_list[p][:k0]) : sum(id_list[p][:k1])] for p, body in enumerate(bodies)]
            )
        n = ids.numel()
        raw = _raw_positions(routes, id_list, k0, k1, device)
        hots = set(routes.hotness[k0:k1])
        if 0 not in hots and len(hots) == 1:  # fixed hotness h everywhere: all by broadcasting
            out[key] = _fixed_group(ids, hots.pop(), routes, k0, k1, world, b_local, raw)
            continue
        lens = lengths[:, k0:k1].reshape(-1)  # per (source, unit, sample): its ids
        compact_k, seq_k = routes.compact[k0:k1], routes.sequence[k0:k1]
        if any(seq_k):
            bags = _sequence_bags(lengths[:, k0:k1], compact_k, seq_k, n)
        else:
            if not any(compact_k):  # a bag for every (source, unit, sample)
                slot_bag = torch.arange(lens.numel(), device=device)
            else:  # compact units: bags only for the samples with ids
                keep = lengths[:, k0:k1] > 0
                if not all(compact_k):
                    fixed = torch.tensor([not c for c in compact_k], device=device)
                    keep = keep | fixed.view(1, -1, 1)
                slot_bag = keep.view(-1).cumsum(0) - 1
            bags = torch.repeat_interleave(slot_bag, lens, output_size=n)
        per_unit = None
        base, scales = routes.row_base[k0:k1], routes.scale[k0:k1]
        if any(base) or any(s != 1.0 for s in scales):  # ids per (source, unit)
            per_unit = torch.tensor([r[k0:k1] for r in id_list], device=device).view(-1)
        if any(base):
            starts = torch.tensor(base, dtype=torch.int64, device=device).repeat(world)
            ids = ids + torch.repeat_interleave(starts, per_unit, output_size=n)
        scale = None
        if any(s != 1.0 for s in scales):
            s = torch.tensor(scales, dtype=torch.float32, device=device)
            scale = torch.repeat_interleave(s.repeat(world), per_unit, output_size=n)
        unit_bags = [row_list[p][k0:k1] for p in range(world)]
        per_rank = [sum(rows) for rows in unit_bags]
        out[key] = GroupInput(ids, bags, scale, sum(per_rank), per_rank, raw, unit_bags)
    return out, flagged


def _sequence_bags(
    lengths: torch.Tensor, compact: list[bool], sequence: list[bool], n: int
) -> torch.Tensor:
    """The bags [n] of a group with sequence units: lengths [W, U_g, B_l] ids per (source,
    unit, sample); a sequence unit's ids a bag each, a compact unit's a bag per sample with
    ids, another's a bag per sample."""
    device = lengths.device
    seq = torch.tensor(sequence, device=device).view(1, -1, 1).expand_as(lengths)
    comp = torch.tensor(compact, device=device).view(1, -1, 1)
    per_segment = torch.where(seq, lengths, torch.where(comp, (lengths > 0).long(), 1))
    per_segment, lens = per_segment.reshape(-1), lengths.reshape(-1)
    first_bag = per_segment.cumsum(0) - per_segment
    first_id = lens.cumsum(0) - lens
    bags = torch.repeat_interleave(first_bag, lens, output_size=n)
    within = torch.arange(n, device=device) - torch.repeat_interleave(first_id, lens, output_size=n)
    return bags + within * torch.repeat_interleave(seq.reshape(-1), lens, output_size=n)


def _raw_positions(
    routes: Routes, id_list: list[list[int]], k0: int, k1: int, device: torch.device
) -> dict[int, torch.Tensor]:
    """Slot position -> where the group's received ids (source rank by source rank, unit by
    unit) hold that dynamic slot's raw ids, in that order. {} without dynamic units."""
    dynamic = [k for k in range(k0, k1) if routes.raw_slot[k] >= 0]
    if not dynamic:
        return {}
    pieces: dict[int, list[torch.Tensor]] = {}
    at = 0
    for counts in id_list:  # the ids of source rank p: its units' in order
        for k in range(k0, k1):
            if routes.raw_slot[k] >= 0:
                piece = torch.arange(at, at + counts[k], device=device)
                pieces.setdefault(routes.raw_slot[k], []).append(piece)
            at += counts[k]
    return {pos: torch.cat(ps) for pos, ps in pieces.items()}


def _fixed_group(
    ids: torch.Tensor,
    hot: int,
    routes: Routes,
    k0: int,
    k1: int,
    world: int,
    b_local: int,
    raw: dict[int, torch.Tensor],
) -> GroupInput:
    """group_inputs for a group whose units all take h ids per sample: ids [W, U, B_l * h]."""
    device = ids.device
    n_units = k1 - k0
    base, scales = routes.row_base[k0:k1], routes.scale[k0:k1]
    if any(base):
        starts = torch.tensor(base, dtype=torch.int64, device=device)
        ids = (ids.view(world, n_units, -1) + starts.view(1, -1, 1)).view(-1)
    num_bags = world * n_units * b_local
    bags = torch.arange(num_bags, device=device)
    if hot > 1:
        bags = bags.repeat_interleave(hot)
    scale = None
    if any(s != 1.0 for s in scales):
        s = torch.tensor(scales, dtype=torch.float32, device=device).view(1, -1, 1)
        scale = s.expand(world, n_units, b_local * hot).reshape(-1)
    unit_bags = [[b_local] * n_units for _ in range(world)]
    return GroupInput(ids, bags, scale, num_bags, [n_units * b_local] * world, raw, unit_bags)
