"""How a table's id columns become bags: fixed hotness, jagged (padded with PAD_ID), or a
sequence (each column its own bag: one row per position).

A batch's ids [B, H] give table t the columns offsets[t]:offsets[t+1] (t.hotness of them).
Not jagged: every column is an id, bag b holds ids [b, :]. Jagged (a list feature): a bag
holds the ids >= 0 of its row, 0..hotness of them; PAD_ID (-1) marks "no id", wherever it
stands. Lookups and exchanges only ever see the real ids, with one bag index or one count
per sample.

Pooling: sum; or mean, which for a fixed hotness h is a per-id scale 1/h inside the lookup,
and for a jagged bag its sum divided by its length after the exchange (`mean_divisors`), on
the rank that owns the sample: a row shard sees only part of a bag, never its length. An
empty bag pools to zeros either way. A sequence (Pooling.NONE) pools nothing: bag
(b, position) holds the id at that position, or none (PAD_ID: a row of zeros).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridrec.types import Pooling, TableConfig


def pooling_scale(table: TableConfig) -> float:
    """The per-id multiplier inside the lookup (jagged means divide later: 1 here)."""
    if table.pooling == Pooling.MEAN and not table.jagged:
        return 1.0 / table.hotness
    return 1.0


def regular_bags(batch_size: int, hotness: int, device: torch.device) -> torch.Tensor:
    """Bag index of ids laid out sample-major as [B, hotness] -> flat [B * hotness]."""
    return torch.arange(batch_size, device=device).repeat_interleave(hotness)


def bag_ids(cols: torch.Tensor, table: TableConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A table's columns [B, h] -> (ids [N], bags [N] non-decreasing) of its real ids; a
    sequence's bags are positions b * h + j (B * h of them)."""
    if not table.jagged:
        return cols.reshape(-1), regular_bags(cols.shape[0], table.hotness, cols.device)
    present = cols >= 0
    if table.sequence:
        flat = present.reshape(-1)
        return cols.reshape(-1)[flat], flat.nonzero().squeeze(1)
    lengths = present.sum(1)
    bags = torch.repeat_interleave(torch.arange(cols.shape[0], device=cols.device), lengths)
    return cols[present], bags


def jagged_means(tables: Sequence[TableConfig]) -> list[int]:
    """Indices of the jagged tables with mean pooling (divided after the exchange)."""
    return [i for i, t in enumerate(tables) if t.jagged and t.pooling == Pooling.MEAN]


def mean_divisors(
    ids: torch.Tensor, means: Sequence[int], offsets: Sequence[int]
) -> dict[int, torch.Tensor]:
    """Table index -> [B, 1] fp32 bag lengths (at least 1) for each of `means` (jagged_means)."""
    out = {}
    for i in means:
        present = ids[:, offsets[i] : offsets[i + 1]] >= 0
        out[i] = present.sum(1, keepdim=True).clamp_(min=1).float()
    return out


def divide_means(
    pooled: torch.Tensor, divisors: dict[int, torch.Tensor], slots: Sequence[int]
) -> torch.Tensor:
    """pooled [B, S, D] with each jagged mean table's sums divided by its bag lengths (the
    other rows divided by 1: unchanged, bit for bit); `slots[i]`: table i's output row."""
    if not divisors:
        return pooled
    B, S = pooled.shape[0], pooled.shape[1]
    denom = torch.ones(B, S, 1, dtype=pooled.dtype, device=pooled.device)
    for i, d in divisors.items():
        denom[:, slots[i]] = d.to(pooled.dtype)
    return pooled / denom
