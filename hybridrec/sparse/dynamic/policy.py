"""A dynamic table's policy as functions on tensors: admission, candidate counts, slot choice.

Every function is per bucket: what it decides for bucket b reads only bucket b's ids and
slots, so a shard holding buckets [b0, b1) decides exactly what one process holding every
bucket decides for them (the equivalence at any world size). Orders are total and fixed:
ids by value, slots by (priority, position in the bucket). No Python loop over ids.

Legend: U distinct ids of a step, A ids to admit, T buckets touched, S slots per bucket
(Sw of them for ids: one less when the bucket keeps an "unknown" row), K candidates.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridrec.sparse.host import policy as host_policy

INT64_MAX = (1 << 63) - 1


def rank_in_bucket(buckets: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[n]: each entry's rank within its bucket when entries are taken in `order` (a
    permutation sorting `buckets` [n] stably); ranks are given in original positions."""
    sb = buckets.index_select(0, order)
    first = torch.searchsorted(sb, sb, right=False)
    rank = torch.arange(sb.numel(), device=sb.device) - first
    return torch.empty_like(rank).index_put_((order,), rank)


def bound_candidates(
    ids: torch.Tensor, counts: torch.Tensor, buckets: torch.Tensor, keep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, counts) of the candidates kept: per bucket the `keep` highest counts, ties to the
    smaller id (ids [K] distinct and ascending, counts [K], their buckets [K]). The bound
    keeps the count policy's memory at `keep` ids per bucket; an id dropped here starts
    counting again when it comes back."""
    if ids.numel() == 0:
        return ids, counts
    by_count = torch.sort(-counts, stable=True).indices  # ids ascending within a count
    order = by_count.index_select(0, torch.sort(buckets.index_select(0, by_count), stable=True)[1])
    kept = rank_in_bucket(buckets, order) < keep
    return ids[kept], counts[kept]


def merge_counts(
    old_ids: torch.Tensor, old_counts: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct ids ascending, summed counts) of two (ids, counts) lists."""
    merged, inverse = torch.unique(torch.cat([old_ids, ids]), return_inverse=True)
    total = torch.zeros(merged.numel(), dtype=torch.int64, device=merged.device)
    return merged, total.index_add_(0, inverse, torch.cat([old_counts, counts]))


def slot_priorities(
    slot_id: torch.Tensor,
    score: torch.Tensor,
    last: torch.Tensor,
    busy: torch.Tensor,
    evict: str,
    clock: int,
    ttl_steps: int,
) -> torch.Tensor:
    """[T, Sw] int64, an eviction takes the lowest first: (lfu score bits | lru/ttl last use)
    shifted past the slot's position j (lowest score or oldest use first, ties to the lower
    position); INT64_MAX for a slot no eviction may take: free (taken from the free list
    instead), `busy` (used this step) or, under ttl, used within the last ttl_steps steps.
    Inputs are [T, Sw]: each slot's id (-1 free), LFU score (fp32 >= 0: its bits order like
    it), last use step."""
    j = torch.arange(slot_id.shape[1], device=slot_id.device)
    level = score.view(torch.int32).long() if evict == "lfu" else last
    prio = (level << 32) | j
    blocked = busy | (slot_id < 0)
    if evict == "ttl":
        blocked = blocked | (clock - last <= ttl_steps)
    return prio.masked_fill_(blocked, INT64_MAX)


def free_lists(slot_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(free [nb, Sw], n_free [nb]) of a shard's slot ids [nb, Sw] (-1: free): each bucket's
    free positions, descending, in free[b, :n_free[b]] (the next one taken is the last: the
    lowest position). A function of the slots alone, so a loaded map rebuilds it exactly."""
    nb, sw = slot_id.shape
    is_free = (slot_id < 0).flip(1)  # column c is position sw - 1 - c
    order = torch.sort((~is_free).to(torch.uint8), dim=1, stable=True).indices
    return (sw - 1) - order, is_free.sum(1)


def choose_slots(
    want_bucket: torch.Tensor,
    free: torch.Tensor,
    n_free: torch.Tensor,
    prio_of: Callable[[torch.Tensor], torch.Tensor],
    bulk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(j [A] the bucket position each id to admit takes, -1 for none; and the extra victims
    an eviction freed: their buckets [V] and positions [V]). Updates free / n_free in place.

    `want_bucket` [A]: each id's local bucket, ids ascending (earlier ids come first in their
    bucket). A bucket's ids take its free positions, lowest first; when they run out, one
    eviction takes the lowest priorities of `prio_of(buckets [T]) -> [T, Sw]`
    (slot_priorities): as many as its ids still need, and at least `bulk` (the victims no id
    takes become its free positions, so the next steps need no eviction); ids left over get
    none (nothing evictable). Per bucket throughout: the same at any world size."""
    A, sw = want_bucket.numel(), free.shape[1]
    order = torch.sort(want_bucket, stable=True).indices
    rank = rank_in_bucket(want_bucket, order)
    nf = n_free.index_select(0, want_bucket)
    from_free = rank < nf
    top = (nf - 1 - rank).clamp_(min=0)
    j = torch.where(from_free, free[want_bucket, top], -1)
    touched, need = torch.unique_consecutive(want_bucket.index_select(0, order), return_counts=True)
    short = need - n_free.index_select(0, touched)
    n_free.index_copy_(0, touched, (-short).clamp_(min=0))
    none = want_bucket.new_zeros(0)
    if A == 0 or int(short.max()) <= 0:
        return j, none, none
    lacking = short > 0
    sb, sneed = touched[lacking], short[lacking]
    prio = prio_of(sb)
    want_k = sneed.clamp(min=bulk).clamp_(max=sw)
    k = int(want_k.max())
    low, pos = torch.topk(prio, k, dim=1, largest=False, sorted=True)
    avail = torch.minimum(want_k, (low != INT64_MAX).sum(1))
    row = torch.searchsorted(sb, want_bucket).clamp_(max=sb.numel() - 1)
    q = rank - nf
    ok = ~from_free & (sb.index_select(0, row) == want_bucket) & (q < avail.index_select(0, row))
    j = torch.where(ok, pos[row, q.clamp(0, k - 1)], j)
    taken = torch.minimum(sneed, avail)
    c = torch.arange(k, device=pos.device)
    extra = (c >= taken.view(-1, 1)) & (c < avail.view(-1, 1))  # [T_s, k]
    ex_row = extra.nonzero()[:, 0]
    ex_pos = pos[extra]
    # they become the bucket's free list (it is empty now): positions descending
    key = torch.sort(ex_row * sw + (sw - 1 - ex_pos)).indices
    ex_row, ex_pos = ex_row.index_select(0, key), ex_pos.index_select(0, key)
    n_extra = avail - taken
    first = torch.cumsum(n_extra, 0) - n_extra
    at = torch.arange(ex_row.numel(), device=pos.device) - first.index_select(0, ex_row)
    ex_bucket = sb.index_select(0, ex_row)
    free[ex_bucket, at] = ex_pos
    n_free.index_copy_(0, sb, n_extra)
    return j, ex_bucket, ex_pos


def record_uses(score: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor) -> None:
    """LFU: score[slots] += counts (the host cache's use counts, host.policy.record_uses)."""
    host_policy.record_uses(score, slots, counts)


def age(score: torch.Tensor, clock: int, halflife: int) -> None:
    """LFU ageing after step `clock`: halve every score once per `halflife` steps (as the
    host cache's counts, host.policy.age)."""
    host_policy.age(score, clock, halflife)
