"""Synthetic multi-hot ids from a one-hot dataset (`data.multi_hot=synthetic`).

Criteo is one-hot: one id per sample and table. MLPerf's DLRM-DCNv2 benchmark trains on a
multi-hot version made from it: each sample's bag of table t holds its original id plus
h_t - 1 more (h_t = the model's `hotness`). This module makes such bags on the fly, when a
batch is read, with a fixed rule, so every reader, loader, rank and epoch sees the same
bag for the same sample:

    bag(t, x) = [x, f(t, x, 1), ..., f(t, x, h_t - 1)],   f = splitmix64(x, t, k) mod R_t

The extra ids are uniform over the table's R_t rows and a pure function of (table, id, k):
a popular id brings the same companions every time. This follows the idea of MLPerf's
materialised multi-hot dataset, not its exact files (those come from its own generator), so
AUC targets measured on those files do not transfer one to one.

ids [B, T] int64 (one column per table) -> [B, sum(h_t)] int64, table-major columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch has no uint64 ops)."""
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN = _signed(0x9E3779B97F4A7C15)
MUL1 = _signed(0xBF58476D1CE4E5B9)
MUL2 = _signed(0x94D049BB133111EB)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping multiplies; arithmetic shifts keep it a
    fixed, well-spread function, which is all the rule needs)."""
    z = (z ^ (z >> 30)) * MUL1
    z = (z ^ (z >> 27)) * MUL2
    return z ^ (z >> 31)


class SyntheticMultiHot:
    """The expansion above for tables of `num_rows` rows and `hotness` ids per bag."""

    def __init__(self, num_rows: Sequence[int], hotness: Sequence[int]) -> None:
        if len(num_rows) != len(hotness):
            raise ValueError(f"{len(num_rows)} tables but {len(hotness)} hotness values")
        self.num_rows, self.hotness = list(num_rows), list(hotness)

    @property
    def needed(self) -> bool:
        return any(h > 1 for h in self.hotness)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] != len(self.num_rows):
            raise ValueError(
                f"one-hot ids must be [batch, {len(self.num_rows)}], got {list(ids.shape)}"
            )
        cols = []
        for t, (rows, h) in enumerate(zip(self.num_rows, self.hotness, strict=True)):
            x = ids[:, t : t + 1]
            cols.append(x)
            if h > 1:
                k = torch.arange(1, h, device=ids.device, dtype=torch.int64) + (t << 20)
                z = _mix(x * GOLDEN + k * MUL2)
                cols.append(z.remainder(rows))
        return torch.cat(cols, dim=1)
