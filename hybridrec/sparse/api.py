"""The one interface between the trainer / checkpoints and embedding modules.

The trainer, its pipeline and the checkpoint code find every embedding module of a model with
`embedding_modules(model)` (a walk over `model.modules()`, so a model may hold several) and
use nothing but the methods below: no `getattr` probes, no imports of the host cache, no
attributes written from outside. Timings go to the active timer (hybridrec.timing.active).

Contract of an EmbeddingModule, at any world size:
    forward(ids [B_l, H] int64) -> pooled [B_l, T, D] ([B_l, sum_t D_t] when the tables'
                                 widths differ; each feature's [B_l, S_f, D] where the
                                 exchange builds them apart: hybridrec.types.Embedded); the
                                 sparse optimizer runs in backward
    sparse_optimizers()          the row optimizers it applies (for learning-rate schedules)
    prefetches / prefetch(ids)   look-ahead (host caches): stage the next batch, collective
    use_staged(staged)           the next forward runs on what `prefetch` staged
    check_inputs()               raise a deferred bad-id error (collective on several ranks)
    warm_start(counts, batch)    fill caches from id frequencies -> WarmStart
    take_metrics()               EmbeddingCounters since the last call, summable over ranks
    take_eval_unknown()          dynamic tables' ids without a row in evaluation, likewise
    shard_views(), replicated_tables(), sparse_step / set_sparse_step   checkpoint state
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from torch import nn

from hybridrec.sparse.dynamic.stats import DynamicStats
from hybridrec.sparse.fused import RowOptimizer
from hybridrec.sparse.host.stats import CacheStats
from hybridrec.types import ShardSpec

ShardView = tuple[ShardSpec, torch.Tensor, dict[str, torch.Tensor]]  # spec, weight, state views
IdCounts = Callable[[int], "np.ndarray | None"]  # table index -> id frequencies [rows] or None


@dataclass(frozen=True)
class WarmStart:
    """What a warm start did: rows loaded on this rank, and the hit rate those rows give
    while ids follow the counts (None: nothing was loaded)."""

    rows: int
    expected_hit_rate: float | None


@dataclass
class EmbeddingCounters:
    """An embedding module's counters since the last reading, typed and summable over modules
    and ranks: its host caches' (None: no rank holds a host-resident shard of its plan) and
    each dynamic table's by name (every dynamic table of the plan, zeros where no shard is
    held, so every rank has the same fields: `values` lists them in one order)."""

    cache: CacheStats | None = None
    dynamic: dict[str, DynamicStats] = field(default_factory=dict)

    def add(self, other: EmbeddingCounters) -> None:
        if other.cache is not None:
            if self.cache is None:
                self.cache = CacheStats()
            self.cache.add(other.cache)
        for name, st in other.dynamic.items():
            self.dynamic.setdefault(name, DynamicStats()).add(st)

    def values(self) -> list[float]:
        """Every counter in a fixed order (the cache's fields, then each table's, by name)."""
        parts = [self.cache] if self.cache is not None else []
        parts += [self.dynamic[t] for t in sorted(self.dynamic)]
        return [float(getattr(p, f.name)) for p in parts for f in fields(p)]

    def with_values(self, values: list[float]) -> EmbeddingCounters:
        """The same counters holding `values` (in the order of `values()`), e.g. summed."""
        it = iter(values)

        def fill(cls: type) -> Any:
            return cls(**{f.name: next(it) for f in fields(cls)})

        cache = fill(CacheStats) if self.cache is not None else None
        return EmbeddingCounters(cache, {t: fill(DynamicStats) for t in sorted(self.dynamic)})


class EmbeddingModule(nn.Module):
    """Base of the embedding modules the trainer and checkpoints drive (see module doc)."""

    #: whether `prefetch` does anything (host-resident tables): the pipeline then reads ahead
    prefetches: bool = False

    def sparse_optimizers(self) -> list[RowOptimizer]:
        raise NotImplementedError

    def prefetch(self, ids: torch.Tensor) -> Any:
        """Start bringing the rows of the next batch's ids [B_l, H] to the device; returns
        what the forward of that batch needs (`use_staged`). Collective when `prefetches`."""
        return None

    def use_staged(self, staged: Any) -> None:
        """The next forward's ids are the ones `prefetch` returned `staged` for."""

    def check_inputs(self) -> None:
        """Raise for a bad id a deferred check met since the last call."""

    def warm_start(self, counts: IdCounts, batch_size: int) -> WarmStart:
        return WarmStart(0, None)

    def take_metrics(self) -> EmbeddingCounters:
        """Counters since the last call (cache hits, dynamic admissions), summable over ranks."""
        return EmbeddingCounters()

    def take_eval_unknown(self) -> EmbeddingCounters:
        """Dynamic tables: ids looked up in evaluation since the last call and those without
        a row (each table's DynamicStats.eval_ids, eval_unknown), summable over ranks."""
        return EmbeddingCounters()

    def shard_views(self) -> list[ShardView]:
        raise NotImplementedError

    def replicated_tables(self) -> set[str]:
        """Tables every rank holds whole: rank 0's copy is the one saved."""
        return set()

    @property
    def sparse_step(self) -> int:
        raise NotImplementedError

    def set_sparse_step(self, step: int) -> None:
        raise NotImplementedError


def embedding_modules(model: nn.Module) -> list[EmbeddingModule]:
    """Every embedding module in `model`'s tree, in module order."""
    return [m for m in model.modules() if isinstance(m, EmbeddingModule)]
