"""Range checks of a batch's ids [B, H] against each column's table, with a precise error.

Valid: 0 <= id < rows (a dynamic table's raw ids: 0 <= id <= RAW_ID_MAX); a jagged table's
columns may also hold PAD_ID (-1, "no id"). Ids come in an integer dtype (ID_DTYPES; a model's
EmbeddingTables widens narrower ones to int64): float ids are refused, as a float32 holds
integers exactly only up to 2^24 (a raw 40-bit id would already be rounded).

On the CPU a bad id raises at once. On CUDA that would cost a host sync every step, so the
check is deferred: bad ids are read as 0 and the first one is recorded on the device, raised
by the next `check_inputs()` (at logging, evaluation or checkpoint time, which sync anyway),
so a bad batch never reaches a checkpoint or a metric.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridrec.types import PAD_ID, TableConfig, hot_offsets

# the largest raw id a dynamic table takes: the range check's bound is exclusive and int64
# (2^63 - 1 itself cannot be checked against a larger bound), and preprocessing gives ids in
# [0, 2^63 - 2] (null: 2^63 - 2, hybridrec.data.tabular.encode.DYNAMIC_NULL)
RAW_ID_MAX = (1 << 63) - 2
# the dtypes ids may come in (hybridrec.model.tables.NARROW_IDS: the ones widened to int64)
ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class IdOutOfRangeError(ValueError):
    """An id outside its table, caught before any kernel reads memory."""


class IdDtypeError(ValueError):
    """Ids that are not integers (float, bool), refused before any kernel reads them."""


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
        self._limits: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.defer = defer
        self._record: torch.Tensor | None = None  # [3] int64: sample, column, id; -1 = none

    def deferred(self, ids: torch.Tensor) -> bool:
        return ids.is_cuda if self.defer is None else self.defer

    def limits(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per column [H]: the smallest valid id (PAD_ID for jagged tables) and the rows."""
        if device not in self._limits:
            low = [PAD_ID if t.jagged else 0 for t in self.tables for _ in range(t.hotness)]
            high = [  # a dynamic table's ids are raw: any id in [0, RAW_ID_MAX]
                t.num_rows if t.dynamic is None else RAW_ID_MAX + 1
                for t in self.tables
                for _ in range(t.hotness)
            ]
            self._limits[device] = (
                torch.tensor(low, dtype=torch.int64, device=device),
                torch.tensor(high, dtype=torch.int64, device=device),
            )
        return self._limits[device]

    def bad_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, H] bool, True where an id is out of range (no host sync); IdDtypeError for
        ids that are not of an integer dtype (ID_DTYPES)."""
        self.check_dtype(ids)
        if ids.dim() != 2 or ids.shape[1] != self.offsets[-1]:
            raise ValueError(
                f"ids must be [batch, {self.offsets[-1]}] (one column per id of the "
                f"{len(self.tables)} tables), got {list(ids.shape)}"
            )
        low, high = self.limits(ids.device)
        return (ids < low) | (ids >= high)

    def check_dtype(self, ids: torch.Tensor) -> None:
        """IdDtypeError naming the first feature (a dynamic table's, if any) when ids [B, H]
        are not of an integer dtype: every feature's ids share the tensor's dtype."""
        if ids.dtype in ID_DTYPES or not self.tables:
            return
        first = next((i for i, t in enumerate(self.tables) if t.dynamic is not None), 0)
        t = self.tables[first]
        others = len(self.tables) - 1
        also = f" and the other {others} feature{'s' * (others > 1)}" if others else ""
        raw = " (a dynamic table's raw ids are int64)" if t.dynamic is not None else ""
        floats = (
            ", converted where they are read, not through a float (a float32 holds integers "
            "exactly only up to 2^24)"
            if ids.dtype.is_floating_point
            else ""
        )
        dtype = str(ids.dtype).removeprefix("torch.")
        raise IdDtypeError(
            f"feature {first} ({t.name}){also}: ids are {dtype}, not integers{raw}; pass int64 "
            f"ids (int32, int16, int8 and uint8 are taken too){floats}"
        )

    def first_error(
        self, ids: torch.Tensor, bad: torch.Tensor, sample_base: int = 0
    ) -> IdOutOfRangeError:
        """The IdOutOfRangeError naming the first bad id's feature, value and table size."""
        b, col = (int(x) for x in bad.nonzero()[0])
        return self._error(col, int(ids[b, col]), f"sample {sample_base + b}")

    def raise_first(self, ids: torch.Tensor, bad: torch.Tensor, sample_base: int = 0) -> None:
        raise self.first_error(ids, bad, sample_base)

    def _error(self, col: int, value: int, where: str, then: str = "") -> IdOutOfRangeError:
        t = next(i for i in range(len(self.tables)) if self.offsets[i + 1] > col)
        table = self.tables[t]
        if table.dynamic is not None:
            what = "is negative" if value < 0 else f"is above {RAW_ID_MAX} (2^63 - 2)"
            return IdOutOfRangeError(
                f"feature {t} ({table.name}): id {value} at {where} {what}; dynamic table "
                f"{table.table_name!r} takes raw ids 0..{RAW_ID_MAX}"
                f"{', or -1 for no id' if table.jagged else ''}{then}"
            )
        return IdOutOfRangeError(
            f"feature {t} ({table.name}): id {value} at {where} is outside table "
            f"{table.table_name!r} of {table.num_rows} rows (valid ids: 0..{table.num_rows - 1}"
            f"{', or -1 for no id' if table.jagged else ''}){then}"
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
