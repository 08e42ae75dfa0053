"""What a host cache keeps: its policy as functions on tensors, with no cache object, no
stream and no host sync of their own (`int()` of a result is the caller's sync).

Scores are LFU with ageing: `freq` [R] counts every row's uses, cached or not (an evicted row
keeps its history), and halves every `age_every` lookups. A slot's score is its row's count;
free slots score 0. Eviction takes the lowest-score slots, never a free slot (free slots are
taken first) nor a kept one (this batch's, or a step's whose backward is pending), and at
least `share` of the cache at a time, so one selection serves several steps' misses.
A warm start scales id counts to the level lookups would settle at (uses per step x the
ageing window, age_every / ln 2 steps), caches the most frequent rows and states the share
of a batch's distinct rows they hit (`warm_hits`), the best any fixed set that size does.

Legend: N = ids, R = group rows, C = cache slots.
"""

from __future__ import annotations

import math

import torch

from hybridrec.kernels import segment
from hybridrec.kernels.segment import Segments


def unique_padded(
    rows: torch.Tensor, segments: Segments | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.unique(rows, return_inverse=True, return_counts=True) without a host sync:
    (distinct rows [N] ascending, inverse [N], counts [N], U [] on the device). Entries past
    U repeat the largest row with count 0, so they index valid rows and add nothing.
    `segments`: segment.sorted_segments(rows), when made already."""
    if rows.numel() == 0:
        return rows, rows, rows, torch.zeros((), dtype=torch.int64, device=rows.device)
    perm, seg, uniq = segments if segments is not None else segment.sorted_segments(rows)
    inverse = torch.empty_like(seg).index_put_((perm,), seg)
    counts = torch.zeros_like(seg).index_add_(0, seg, torch.ones_like(seg))
    return uniq, inverse, counts, seg[-1] + 1


def record_uses(freq: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> None:
    """freq[rows] += counts, in place (rows distinct)."""
    freq.index_add_(0, rows, counts.float())


def age(freq: torch.Tensor, lookups: int, age_every: int) -> None:
    """After the `lookups`-th lookup: halve every count, in place, once per `age_every`."""
    if lookups % age_every == 0:
        freq.mul_(0.5)


def slot_scores(freq: torch.Tensor, row_of_slot: torch.Tensor) -> torch.Tensor:
    """[C] fp32, a new tensor: each slot's row's count (freq [R]), 0 for a free slot (row -1)."""
    used = row_of_slot >= 0
    return torch.where(used, freq.index_select(0, row_of_slot.clamp(min=0)), 0.0)


def kept(*slots: torch.Tensor | None) -> torch.Tensor:
    """Slots new rows may not take, one tensor: this batch's (-1 for its misses), those
    whose backward is pending, those a prefetch admitted for its lookup (None: none)."""
    return torch.cat([s for s in slots if s is not None])


def eviction_scores(
    score: torch.Tensor, free_slots: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """[C]: `score` [C] with inf for the free slots and for `keep` (slots; -1 ignored): the
    finite entries are the slots an eviction may take. No host sync: index_fill_ takes its
    value as a kernel argument (`masked[i] = inf` would copy it from pageable host memory)."""
    C = score.numel()
    masked = torch.cat([score, score.new_zeros(1)])  # [C + 1]: index C takes the -1s
    masked.index_fill_(0, free_slots, float("inf"))  # taken first, before any eviction
    masked.index_fill_(0, torch.where(keep < 0, C, keep), float("inf"))
    return masked[:C]


def evictable(masked: torch.Tensor) -> torch.Tensor:
    """[] on the device: how many slots an eviction may take (finite `eviction_scores`)."""
    return torch.isfinite(masked).sum()


def choose_victims(
    masked: torch.Tensor, short: int, n_evictable: int, share: float
) -> torch.Tensor | None:
    """Slots to evict when `short` (> 0) more are needed than are free: the lowest of
    `masked` (eviction_scores [C]), at least `share` of the cache (the victims past `short`
    become free slots), never more than the `n_evictable` finite ones; None when fewer than
    `short` may go. In no particular order."""
    if n_evictable < short:
        return None
    n_evict = min(n_evictable, max(short, int(masked.numel() * share)))
    return torch.topk(masked, n_evict, largest=False, sorted=False).indices


def ageing_window(age_every: int) -> float:
    """Steps over which counts settle under halving every `age_every`: age_every / ln 2
    (a row used u times a step reaches u x this)."""
    return age_every / math.log(2)


def warm_size(frequency: torch.Tensor, capacity: int) -> int:
    """Rows a warm start loads: every row with a count, at most `capacity`."""
    return min(capacity, int((frequency > 0).sum()))


def warm_counts(frequency: torch.Tensor, ids_per_step: float, age_every: int) -> torch.Tensor:
    """[R] fp32: id counts `frequency` [R] (not all 0) scaled to the counts lookups would
    have reached: each row's expected uses per step (a share of `ids_per_step`) times the
    ageing window. On that scale a row met once does not outrank the warm rows."""
    freq = frequency.double()
    total = float(freq.sum())
    return (freq * (ids_per_step * ageing_window(age_every) / total)).float()


def warm_rows(freq: torch.Tensor, n: int) -> torch.Tensor:
    """[n] the rows of the `n` highest counts of `freq` [R], ascending (sorted host reads)."""
    return torch.topk(freq, n).indices.sort().values


def warm_hits(freq: torch.Tensor, rows: torch.Tensor, age_every: int) -> tuple[float, float]:
    """(sum over `rows`, sum over all rows) of the chance a row is among a step's ids, were
    ids drawn as `freq` (warm_counts) says: 1 - e^-(uses per step), uses = freq / window.
    Their ratio is the hit rate `rows` give over a batch's distinct rows."""
    present = -torch.expm1(-freq / ageing_window(age_every))  # fp32, as freq
    return (
        float(present[rows].sum(dtype=torch.float64)),
        float(present.sum(dtype=torch.float64)),
    )
