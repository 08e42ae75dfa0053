"""Synthetic Criteo-shaped data: endless, deterministic, learnable, never stored.

Batch `step` of split `split` is a pure function of (seed, split, step, batch size), so any
rank can produce any global batch and a resumed run sees the same stream.

- dense [B, 13]: log(1 + counts), counts log-normal (heavy-tailed like Criteo's integers).
- ids: per table, Zipf-like popularity (P(rank k) ~ 1/k^s over the table's rows), drawn by
  inverting the continuous power-law CDF; the popularity ranks are scrambled over the rows
  by a bijection (k * P + c) mod n, with P a prime larger than any table, so hot rows are
  spread over the table like real hashed ids (this matters for row-wise sharding). A jagged
  table's bags hold a uniform 0..hotness of them, padded with PAD_ID (empty bags included).
- labels: Bernoulli(sigmoid(teacher logit)); the hidden teacher gives every (table, row) a
  fixed pseudo-random value in [-1, 1] from an integer hash, and the dense features a fixed
  linear weight. A model can learn the hot rows' values, so AUC rises clearly above 0.5.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hybridrec.data.loader import BatchSource
from hybridrec.types import PAD_ID, Batch, TableConfig, hot_offsets

_PRIME = 2_147_483_647  # 2^31 - 1: larger than any table, so k -> k*P mod n is a bijection
_SPLITS = {"train": 0, "eval": 1}


class SyntheticCriteo(BatchSource):
    """A seeded, endless stream of Criteo-shaped batches for the given tables (no rows or
    names to report: BatchSource's defaults)."""

    def __init__(
        self,
        tables: Sequence[TableConfig],
        num_dense: int = 13,
        seed: int = 0,
        zipf_exponent: float = 1.05,
        teacher_scale: float = 1.5,
        label_noise: float = 0.0,
    ) -> None:
        self.tables = list(tables)
        self.num_dense = num_dense
        self.seed = seed
        self.s = zipf_exponent
        self.teacher_scale = teacher_scale
        self.label_noise = label_noise
        self.offsets = hot_offsets(self.tables)
        g = torch.Generator().manual_seed(seed * 7_777 + 12_345)
        self.dense_weight = torch.randn(num_dense, generator=g) / num_dense**0.5
        self.table_weight = torch.rand(len(self.tables), generator=g) + 0.5
        self.salts = torch.randint(1, 1 << 30, (len(self.tables), 2), generator=g)
        self.dense_mean = self._dense(4096, g).mean(0)  # centres the teacher's dense term

    def _dense(self, batch_size: int, g: torch.Generator) -> torch.Tensor:
        counts = torch.exp(torch.randn(batch_size, self.num_dense, generator=g) * 1.5 + 1.0)
        return torch.log1p(counts.floor())

    def _generator(self, split: str, step: int) -> torch.Generator:
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
        seed = (self.seed * 1_000_003 + _SPLITS[split] * 998_244_353 + step * 7_919) % (1 << 62)
        return torch.Generator().manual_seed(seed)

    def _zipf_ids(self, n: int, count: tuple[int, ...], g: torch.Generator, t: int) -> torch.Tensor:
        """Ids in [0, n) with P(popularity rank k) ~ 1/(k+1)^s, ranks scrambled over rows."""
        u = torch.rand(count, generator=g, dtype=torch.float64)
        if abs(self.s - 1.0) < 1e-9:
            x = torch.exp(u * torch.log(torch.tensor(n + 1.0, dtype=torch.float64)))
        else:
            a = 1.0 - self.s
            x = ((float(n + 1) ** a - 1.0) * u + 1.0) ** (1.0 / a)
        rank = (x.floor().long() - 1).clamp_(0, n - 1)
        return self._row_of_rank(rank, t, n)

    def _row_of_rank(self, rank: torch.Tensor, t: int, n: int) -> torch.Tensor:
        """The row of popularity rank `rank` in table t: a fixed bijection of [0, n)."""
        return (rank * _PRIME + int(self.salts[t, 0])) % n

    def id_counts(self, table_index: int) -> np.ndarray:
        """Expected uses of every row of table `table_index` per million samples, [num_rows]
        float64: the popularity the ids are drawn from (as a manifest's counts are for real
        data), so host caches warm-start with the truly hottest rows."""
        table = self.tables[table_index]
        n = table.num_rows
        rank = torch.arange(n, dtype=torch.float64)
        if abs(self.s - 1.0) < 1e-9:
            p = torch.log((rank + 2) / (rank + 1)) / torch.log(torch.tensor(n + 1.0))
        else:
            a = 1.0 - self.s
            p = ((rank + 2) ** a - (rank + 1) ** a) / (float(n + 1) ** a - 1.0)
        rows = self._row_of_rank(torch.arange(n), table_index, n)
        counts = torch.empty(n, dtype=torch.float64)
        counts[rows] = p * (1e6 * table.hotness)
        return counts.numpy()

    def _row_value(self, t: int, ids: torch.Tensor) -> torch.Tensor:
        """The teacher's fixed value in [-1, 1] for rows `ids` of table t (an integer hash)."""
        h = (ids * 2_654_435_761 + int(self.salts[t, 1])) % _PRIME
        h = (h * 40_503 + 12_345) % _PRIME
        return h.double() / (_PRIME - 1) * 2.0 - 1.0

    def steps_per_epoch(self, batch_size: int, split: str = "train") -> int | None:
        return None  # endless

    def batch(self, step: int, batch_size: int, split: str = "train") -> Batch:
        """Global batch number `step` of `split` ('train' or 'eval')."""
        g = self._generator(split, step)
        dense = self._dense(batch_size, g)
        cols, logit = [], torch.zeros(batch_size, dtype=torch.float64)
        for t, table in enumerate(self.tables):
            ids = self._zipf_ids(table.num_rows, (batch_size, table.hotness), g, t)
            value = self._row_value(t, ids)
            if table.jagged:  # keep the first `length` ids of each bag
                length = torch.randint(0, table.hotness + 1, (batch_size, 1), generator=g)
                present = torch.arange(table.hotness) < length
                ids = ids.masked_fill(~present, PAD_ID)
                value = value * present
            cols.append(ids)
            value = value.sum(1) / table.hotness**0.5
            logit += float(self.table_weight[t]) * value
        logit = (
            logit / len(self.tables) ** 0.5
            + (dense - self.dense_mean).double() @ self.dense_weight.double()
        )
        prob = torch.sigmoid(self.teacher_scale * logit - 1.3)
        labels = (torch.rand(batch_size, generator=g, dtype=torch.float64) < prob).float()
        if self.label_noise > 0:
            flip = torch.rand(batch_size, generator=g) < self.label_noise
            labels = torch.where(flip, 1.0 - labels, labels)
        return Batch(dense, torch.cat(cols, dim=1), labels)
