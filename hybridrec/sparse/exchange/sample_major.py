"""The exchange of one rank whose one group holds every table whole: bags numbered sample-major.

With one process, equal widths and no replicated tables (every DLRM), the rank's one fused
group holds every table, in order. Its lookup can then number its bags sample-major,
bag (b, s) = b * S + s for output row s of sample b (a pooled feature's one row, or a
sequence's row per position: S rows per sample in all), following the ids' own [B, H]
layout: its output [B * S, D] is the collection's [B, S, D] as it is, and the gradient
arrives the same way, with no per-table split, stack or cat in either pass (each would copy
the whole [B, S, D] tensor). Each row's ids still come in sample order, so sums and updates
equal the all-to-all's one-rank numbering (source rank, unit, sample) bit for bit. Nothing
crosses a process: routing is numbering.

A dynamic table's columns carry raw ids: they get no row offset here and are listed in the
group's input (`GroupInput.raw`) for their map (hybridrec.sparse.dynamic.remap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridrec.sparse.bags import divide_means, jagged_means, mean_divisors, pooling_scale
from hybridrec.sparse.layout import GroupKey, ShardedLayout
from hybridrec.sparse.step import GroupInput, StepContext
from hybridrec.types import TableConfig, hot_offsets, slot_offsets


@dataclass(frozen=True)
class SampleMajorLayout:
    """Per column of ids [B, H]: the row offset of its table in the group (0 for a dynamic
    table's raw ids), its output row in a sample (`slot`: its feature's, plus its position
    in a sequence), its pooling scale (None when all are 1); output rows per sample S;
    whether some columns are jagged (their PAD_ID entries are no ids: left out of rows and
    bags); per dynamic slot position, its columns: their indices [h] and mask [H] (bool)."""

    num_slots: int
    row_offset: torch.Tensor
    slot: torch.Tensor
    scale: torch.Tensor | None
    jagged: bool
    dynamic: dict[int, tuple[torch.Tensor, torch.Tensor]]


def sample_major_layout(
    tables: Sequence[TableConfig],
    row_offsets: Sequence[int],
    dynamic_slot: Sequence[int],
    device: torch.device,
) -> SampleMajorLayout:
    """`row_offsets`: per feature, where its table's rows start in the group;
    `dynamic_slot`: per feature, its table's slot position if the table is dynamic, else -1."""
    cols = [(i, t) for i, t in enumerate(tables) for _ in range(t.hotness)]
    scales = [pooling_scale(t) for _, t in cols]
    first = slot_offsets(tables)
    slot = [
        first[i] + (j if t.sequence else 0) for i, t in enumerate(tables) for j in range(t.hotness)
    ]
    dynamic = {}
    for pos in sorted({p for p in dynamic_slot if p >= 0}):
        mask = torch.tensor([dynamic_slot[i] == pos for i, _ in cols], device=device)
        dynamic[pos] = (mask.nonzero().squeeze(1), mask)
    return SampleMajorLayout(
        first[-1],
        torch.tensor(
            [0 if dynamic_slot[i] >= 0 else row_offsets[i] for i, _ in cols], device=device
        ),
        torch.tensor(slot, device=device),
        None
        if all(s == 1.0 for s in scales)
        else torch.tensor(scales, dtype=torch.float32, device=device),
        any(t.jagged for t in tables),
        dynamic,
    )


def sample_major_inputs(ids: torch.Tensor, layout: SampleMajorLayout) -> GroupInput:
    """ids [B, H] (checked) -> the group's lookup: rows [N], bags [N] (b * S + slot,
    non-decreasing), per-id scales [N] or None; N = B * H, or the ids >= 0 if jagged; raw:
    where each dynamic slot's ids are. Jagged columns: one pass finds the real ids."""
    B, H = ids.shape
    S = layout.num_slots
    if not layout.jagged:
        rows = (ids + layout.row_offset).reshape(-1)
        first = torch.arange(B, device=ids.device).unsqueeze(1) * S
        bags = (first + layout.slot).reshape(-1)
        scale = layout.scale.expand(B, -1).reshape(-1) if layout.scale is not None else None
        first = torch.arange(B, device=ids.device).unsqueeze(1) * H
        raw = {pos: (first + c).reshape(-1) for pos, (c, _) in layout.dynamic.items()}
        return GroupInput(rows, bags, scale, B * S, [B * S], raw)
    flat = ids.reshape(-1)
    where = (flat >= 0).nonzero().squeeze(1)  # positions of the real ids, in sample order
    col = where.remainder(H)
    rows = flat.index_select(0, where) + layout.row_offset.index_select(0, col)
    bags = where.div(H, rounding_mode="floor") * S + layout.slot.index_select(0, col)
    scale = layout.scale.index_select(0, col) if layout.scale is not None else None
    raw = {
        pos: m.index_select(0, col).nonzero().squeeze(1) for pos, (_, m) in layout.dynamic.items()
    }
    return GroupInput(rows, bags, scale, B * S, [B * S], raw)


class SampleMajor:
    """The Exchange (hybridrec.sparse.step) of a one-rank layout with a sample-major group."""

    pools_in_handoff = True  # its lookup's output is the hand-off itself: pooled in its dtype

    def __init__(self, layout: ShardedLayout, key: GroupKey, device: torch.device) -> None:
        slots = layout.input_slots(key)
        units = [layout.local_units[k] for k in layout.group_units[key]]
        rows = layout.slot_rows(key)
        start = {u.table_index: rows[p] for u, p in zip(units, slots, strict=True)}
        dynamic = {u.table_index: p if u.dynamic else -1 for u, p in zip(units, slots, strict=True)}
        n = len(layout.tables)
        self.key, self.width = key, key.width
        self.layout = sample_major_layout(
            layout.tables, [start[f] for f in range(n)], [dynamic[f] for f in range(n)], device
        )
        self.means, self.offsets = jagged_means(layout.tables), hot_offsets(layout.tables)
        self.slots = slot_offsets(layout.tables)

    def route(
        self, ids: torch.Tensor, flag: bool | None, share_batch: bool = False
    ) -> tuple[StepContext, bool]:
        """The group's lookup of ids [B, H]: one rank, so no rank to flag a bad id to (nor
        batch size to share)."""
        return StepContext(ids, {self.key: sample_major_inputs(ids, self.layout)}), False

    def deliver(self, pooled: dict[GroupKey, torch.Tensor], step: StepContext) -> torch.Tensor:
        """The group's pooled [B * S, D] as [B, S, D], jagged means divided by their lengths."""
        B = step.ids.shape[0]
        out = pooled[self.key].view(B, self.layout.num_slots, self.width)
        return divide_means(out, mean_divisors(step.ids, self.means, self.offsets), self.slots)
