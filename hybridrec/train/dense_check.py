"""NaN or inf dense features of a batch, reported as bad input (train.check_ids).

A non-finite dense value makes the loss NaN, and the loss watch (hybridrec.train.health)
would then blame the learning rates; this check names the input instead: the feature (index
and, when the dataset has them, its name), the sample (its position in the global batch and,
when the data is a preprocessed dataset read by fit, its row) and the value.

Like the id checks (hybridrec.sparse.ids.IdChecker): a single CPU process raises at once; on
CUDA, or with several ranks, raising at once would cost a host sync or a collective every
step, so the check is deferred: bad values are read as 0 and the first one is recorded on the
device, raised by `raise_recorded` (from the trainer's check_inputs, at logging, evaluation or
checkpoint time, before the loss watch reads the loss), so a bad batch never reaches a
checkpoint or a metric, and the error is the input's, not the learning rate's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hybridrec.data.loader import BatchSource
from hybridrec.distributed.comm import any_rank
from hybridrec.distributed.env import DistEnv

# (batch index, sample in the global batch) -> "dataset row ..." or None when unknown
Locate = Callable[[int, int], "str | None"]


class NonFiniteInputError(ValueError):
    """A dense feature of a batch is NaN or inf; the message names the feature and sample."""


class DenseChecker:
    """Finite-value check of dense [B_l, F] features; see the module docstring."""

    def __init__(
        self, env: DistEnv, names: Sequence[str] | None = None, split: str = "train"
    ) -> None:
        self.env, self.split = env, split
        self.names = list(names) if names else None
        self.defer = env.device.type == "cuda" or env.world_size > 1
        self.locate: Locate | None = None  # set by fit while it trains on the loader's batches
        self._record: torch.Tensor | None = None  # [3] int64: batch, sample, column; -1 = none
        self._value: torch.Tensor | None = None  # [] float32: the bad value

    def __call__(self, dense: torch.Tensor, batch: int, sample_base: int = 0) -> torch.Tensor:
        """dense, checked: raises at once (a single CPU process) or returns it with the bad
        values set to 0 and the first recorded (deferred; no host sync)."""
        readable = dense.device.type == "cpu" and (not self.defer or self.env.world_size > 1)
        if readable and bool(torch.isfinite(dense.sum())):
            # A NaN or inf makes the sum one, so a finite sum proves every value finite, at a
            # fraction of isfinite's cost (a sum that overflows takes the full check below).
            # Reading it costs nothing on the CPU, where several ranks defer only to spare a
            # collective (a deferred single CPU process stands for CUDA: tests).
            return dense
        bad = ~torch.isfinite(dense)
        if not self.defer:
            if bool(bad.any()):
                b, col = (int(x) for x in bad.nonzero()[0])
                raise self._error(batch, sample_base + b, col, float(dense[b, col]))
            return dense
        flat = bad.reshape(-1)
        first = flat.to(torch.int8).argmax()  # the first bad position (0 when none is bad)
        width = dense.shape[1]
        # index_select, not dense.reshape(-1)[first]: indexing with a tensor reads it (a sync)
        value = dense.reshape(-1).index_select(0, first.view(1)).squeeze(0).float()
        found = torch.stack([torch.full_like(first, batch), first // width + sample_base])
        found = torch.cat([found, (first % width).view(1)])
        if self._record is None or self._record.device != dense.device:
            self._record = torch.full((3,), -1, dtype=torch.int64, device=dense.device)
            self._value = torch.zeros((), dtype=torch.float32, device=dense.device)
        keep = (self._record[0] >= 0) | ~flat.any()
        self._record = torch.where(keep, self._record, found)
        self._value = torch.where(keep, self._value, value)
        return dense.masked_fill(bad, 0.0)

    def raise_recorded(self) -> None:
        """Raise, on every rank, for the first bad value recorded on any rank since the last
        call (a host sync; a collective on several ranks)."""
        local = self._record is not None and int(self._record[0]) >= 0
        if not self.defer or not any_rank(local, self.env.group, self.env.device, "dense_check"):
            return
        if not local:
            raise NonFiniteInputError(
                f"rank {self.env.rank}: another rank found a NaN or inf dense feature in a "
                "batch since the last check (that rank's error names the feature and sample)"
            )
        assert self._record is not None and self._value is not None
        batch, sample, col = (int(x) for x in self._record.tolist())
        value = float(self._value)
        self._record = self._value = None
        raise self._error(batch, sample, col, value, "; the run stops here")

    def _error(
        self, batch: int, sample: int, col: int, value: float, then: str = ""
    ) -> NonFiniteInputError:
        name = f" ({self.names[col]})" if self.names and col < len(self.names) else ""
        row = self.locate(batch, sample) if self.locate is not None else None
        step = f"training step {batch + 1}" if self.split == "train" else f"eval batch {batch}"
        where = f"sample {sample} of {step}" + (f" ({row})" if row else "")
        return NonFiniteInputError(
            f"dense feature {col}{name} is {value} at {where}: bad input data, not a "
            f"learning-rate problem; fix or drop that row (train.check_ids checks inputs){then}"
        )


def dataset_locator(
    source: BatchSource, batch_size: int, split: str = "train", first: int = 0
) -> Locate:
    """Maps (batch index, sample) of a split's stream to where the source read it from (a
    preprocessed dataset's row; None where the source cannot tell: BatchSource.row_of).
    `first`: the step whose batch is the split's batch 0 (train.count_from=resume)."""

    def locate(batch: int, sample: int) -> str | None:
        return source.row_of(batch - first, batch_size, split, sample)

    return locate


def dense_names(source: BatchSource) -> list[str] | None:
    """The dense features' names the source knows (a dataset manifest's I1..I13 for
    Criteo); None when it knows none."""
    return source.dense_names()
