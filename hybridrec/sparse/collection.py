"""The single-process embedding collection: every table on this process.

This is the reference the sharded collection (hybridrec.sparse.sharded) must match. Both
share one interface, so the model never knows which one it holds:

    forward(ids [B, H] int64) -> pooled [B, T, D] fp32

and the sparse optimizer runs inside the backward (see hybridrec.sparse.fused). With
`autocast_output` (set when the dense part's first use of the pooled embeddings casts them
to the autocast dtype, as DLRM's dot interaction does) the pooled tensor comes out in the
autocast dtype under autocast: the same bits, without writing the fp32 tensor, reading it
back to cast it, and the same again for its gradient.
Tables are grouped by width; each group is one FusedEmbedding with one lookup. When one group
holds every table (equal widths, as in DLRM), its bags are numbered sample-major so its
output already is [B, T, D]: no stack in the forward, no cat in the backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridrec.sparse.fused import FusedEmbedding, LookupInput, RowOptimizer, regular_bags
from hybridrec.timing import NULL_TIMER, PhaseTimer
from hybridrec.types import Pooling, ShardSpec, TableConfig, hot_offsets


class IdOutOfRangeError(ValueError):
    """An id outside its table, caught before any kernel reads memory."""


def full_shard(table: TableConfig, rank: int = 0) -> ShardSpec:
    return ShardSpec(table.name, rank, 0, table.num_rows, 0, table.dim)


def pooling_scale(table: TableConfig) -> float:
    return 1.0 / table.hotness if table.pooling == Pooling.MEAN else 1.0


class IdChecker:
    """Range check of ids [B, H] against each column's table size, with a precise error.

    On the CPU a bad id raises at once. On CUDA that would cost a host sync every step, so
    the check is deferred (`defer`, default: on CUDA): `sanitize` replaces bad ids with 0
    before any kernel reads memory and records the first bad one on the device; the trainer
    raises its error (`raise_recorded`) at the next logging step, evaluation or checkpoint,
    where it syncs anyway, so a bad batch never reaches a checkpoint or a metric.
    """

    def __init__(self, tables: Sequence[TableConfig], defer: bool | None = None) -> None:
        self.tables = list(tables)
        self.offsets = hot_offsets(self.tables)
        self._limits: dict[torch.device, torch.Tensor] = {}
        self.defer = defer
        self._record: torch.Tensor | None = None  # [3] int64: sample, column, id; -1 = none

    def deferred(self, ids: torch.Tensor) -> bool:
        return ids.is_cuda if self.defer is None else self.defer

    def limits(self, device: torch.device) -> torch.Tensor:
        if device not in self._limits:
            lim = [t.num_rows for t in self.tables for _ in range(t.hotness)]
            self._limits[device] = torch.tensor(lim, dtype=torch.int64, device=device)
        return self._limits[device]

    def bad_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, H] bool, True where an id is out of range (no host sync)."""
        if ids.dim() != 2 or ids.shape[1] != self.offsets[-1]:
            raise ValueError(
                f"ids must be [batch, {self.offsets[-1]}] (one column per id of the "
                f"{len(self.tables)} tables), got {list(ids.shape)}"
            )
        return (ids < 0) | (ids >= self.limits(ids.device))

    def raise_first(self, ids: torch.Tensor, bad: torch.Tensor, sample_base: int = 0) -> None:
        """Raise IdOutOfRangeError naming the first bad id's feature, value and table size."""
        b, col = (int(x) for x in bad.nonzero()[0])
        raise self._error(col, int(ids[b, col]), f"sample {sample_base + b}")

    def _error(self, col: int, value: int, where: str, then: str = "") -> IdOutOfRangeError:
        t = next(i for i in range(len(self.tables)) if self.offsets[i + 1] > col)
        table = self.tables[t]
        return IdOutOfRangeError(
            f"feature {t} ({table.name}): id {value} at {where} is outside table "
            f"{table.name!r} of {table.num_rows} rows (valid ids: 0..{table.num_rows - 1}){then}"
        )

    def __call__(self, ids: torch.Tensor, sample_base: int = 0) -> None:
        bad = self.bad_mask(ids)
        if bool(bad.any()):
            self.raise_first(ids, bad, sample_base)

    def sanitize(self, ids: torch.Tensor, sample_base: int = 0) -> torch.Tensor:
        """ids with out-of-range ones replaced by 0; the first bad id (sample, column, value)
        is remembered on the device until `raise_recorded`. No host sync."""
        bad = self.bad_mask(ids)
        flat = bad.reshape(-1)
        first = flat.to(torch.int8).argmax()  # the first bad position (0 when none is bad)
        width = ids.shape[1]
        # index_select, not ids.reshape(-1)[first]: indexing with a tensor reads it (a sync)
        value = ids.reshape(-1).index_select(0, first.view(1)).squeeze(0)
        found = torch.stack([first // width + sample_base, first % width, value])
        if self._record is None or self._record.device != ids.device:
            self._record = torch.full((3,), -1, dtype=torch.int64, device=ids.device)
        keep = (self._record[0] >= 0) | ~flat.any()
        self._record = torch.where(keep, self._record, found)
        return ids.masked_fill(bad, 0)

    def found(self) -> bool:
        """Whether `sanitize` has met a bad id since the last `raise_recorded` (a host sync)."""
        return self._record is not None and int(self._record[0]) >= 0

    def raise_recorded(self) -> None:
        """Raise IdOutOfRangeError for the first bad id `sanitize` met, if any (a host sync)."""
        if not self.found():
            return
        assert self._record is not None
        sample, col, value = (int(x) for x in self._record.tolist())
        self._record = None
        where = f"sample {sample} of a batch since the last check"
        raise self._error(col, value, where, "; those ids were read as 0 and the run stops here")


@dataclass
class SampleMajorLayout:
    """Per column of ids [B, H]: the row offset of its table in the group, its table index,
    its pooling scale (None when all are 1); and the number of tables T."""

    num_tables: int
    row_offset: torch.Tensor
    table: torch.Tensor
    scale: torch.Tensor | None


def sample_major_layout(tables: Sequence[TableConfig], group: FusedEmbedding) -> SampleMajorLayout:
    """When one group holds every table, in order, a lookup can number its bags sample-major,
    bag (b, t) = b * T + t, following the ids' own [B, H] layout; its output [B * T, D] is
    then pooled [B, T, D] as it is, and the gradient arrives the same way: no per-table
    split, stack or cat in either pass (each would copy the whole [B, T, D] tensor). Each
    row's ids still come in sample order, so sums and updates match the per-table path bit
    for bit."""
    device = group.row_offsets.device
    cols = [(i, t) for i, t in enumerate(tables) for _ in range(t.hotness)]
    scales = [pooling_scale(t) for _, t in cols]
    return SampleMajorLayout(
        len(tables),
        torch.tensor([group.offsets_list[i] for i, _ in cols], device=device),
        torch.tensor([i for i, _ in cols], device=device),
        None
        if all(s == 1.0 for s in scales)
        else torch.tensor(scales, dtype=torch.float32, device=device),
    )


def sample_major_rows(ids: torch.Tensor, layout: SampleMajorLayout) -> torch.Tensor:
    """ids [B, H] -> the group rows [B * H] they read, in the layout's order."""
    return (ids + layout.row_offset).reshape(-1)


def lookup_sample_major(
    ids: torch.Tensor,
    layout: SampleMajorLayout,
    group: FusedEmbedding,
    out_dtype: torch.dtype,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """ids [B, H] (checked) -> pooled [B, T, D] in out_dtype, through `group.lookup`; `rows`:
    sample_major_rows(ids, layout) when already made (a host cache knows the very tensor it
    prefetched)."""
    B, T = ids.shape[0], layout.num_tables
    first = torch.arange(B, device=ids.device).unsqueeze(1) * T
    bags = (first + layout.table).reshape(-1)
    scale = layout.scale
    if scale is not None:
        scale = scale.expand(B, -1).reshape(-1)
    if rows is None:
        rows = sample_major_rows(ids, layout)
    pooled = group.lookup(rows, bags, scale, B * T, out_dtype)
    return pooled.view(B, T, group.width)


class EmbeddingCollection(nn.Module):
    """All T tables on one process, grouped by width into fused lookups."""

    def __init__(
        self,
        tables: Sequence[TableConfig],
        optimizer: RowOptimizer | None,
        seed: int = 0,
        device: torch.device | str = "cpu",
        check_ids: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        self.offsets = hot_offsets(self.tables)
        self.checker = IdChecker(self.tables) if check_ids else None
        self.timer: PhaseTimer = NULL_TIMER  # the trainer sets its own
        by_width: dict[int, list[int]] = {}
        for i, t in enumerate(self.tables):
            by_width.setdefault(t.dim, []).append(i)
        self.group_tables = {f"w{w}": idx for w, idx in by_width.items()}
        self.groups = nn.ModuleDict(
            {
                key: FusedEmbedding(
                    [(self.tables[i], i, full_shard(self.tables[i])) for i in idx],
                    optimizer,
                    seed,
                    device,
                    dtype,
                )
                for key, idx in self.group_tables.items()
            }
        )
        self.sample_major = self._sample_major_layout()
        self.autocast_output = False

    def shard_views(self) -> list[tuple[ShardSpec, torch.Tensor, dict[str, torch.Tensor]]]:
        """Every shard held here: (spec, weight view [rows, width], optimizer-state views)."""
        return [view for group in self.groups.values() for view in group.shard_views()]

    def raise_bad_ids(self) -> None:
        """Raise for a bad id a deferred check met (see IdChecker); a host sync."""
        if self.checker is not None:
            self.checker.raise_recorded()

    def out_dtype(self, device: torch.device) -> torch.dtype:
        """fp32, or the autocast dtype under autocast with `autocast_output`."""
        if self.autocast_output and torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, H] int64 -> pooled [B, T, D] fp32 (see `out_dtype`)."""
        if self.checker is not None:
            if self.checker.deferred(ids):
                ids = self.checker.sanitize(ids)
            else:
                self.checker(ids)
        B = ids.shape[0]
        if self.sample_major is not None:
            with self.timer.phase("lookup"):
                return self._lookup_sample_major(ids)
        out: list[torch.Tensor | None] = [None] * len(self.tables)
        with self.timer.phase("lookup"):
            self._lookup(ids, B, out)
        return torch.stack(out, dim=1).to(self.out_dtype(ids.device))  # type: ignore[arg-type]

    def _sample_major_layout(self) -> SampleMajorLayout | None:
        """One group holding every table in order (same widths: every DLRM): see
        `sample_major_layout`."""
        if list(self.group_tables.values()) != [list(range(len(self.tables)))]:
            return None
        return sample_major_layout(self.tables, next(iter(self.groups.values())))

    def _lookup_sample_major(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.sample_major is not None
        group: FusedEmbedding = next(iter(self.groups.values()))
        return lookup_sample_major(ids, self.sample_major, group, self.out_dtype(ids.device))

    def _lookup(self, ids: torch.Tensor, B: int, out: list[torch.Tensor | None]) -> None:
        for key, group in self.groups.items():
            idx = self.group_tables[key]
            inputs = []
            for i in idx:
                t = self.tables[i]
                cols = ids[:, self.offsets[i] : self.offsets[i + 1]]
                bags = regular_bags(B, t.hotness, ids.device)
                inputs.append(LookupInput(cols.reshape(-1), bags, B, pooling_scale(t)))
            for i, pooled in zip(idx, group(inputs), strict=True):
                out[i] = pooled
