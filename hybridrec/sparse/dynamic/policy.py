"""A dynamic table's policy as functions on tensors: admission, candidate counts, slot choice.

Every function is per bucket: what it decides for bucket b reads only bucket b's ids and
slots, so a shard holding buckets [b0, b1) decides exactly what one process holding every
bucket decides for them (the equivalence at any world size). Orders are total and fixed:
ids by value, slots by (priority, position in the bucket). No Python loop over ids.

Legend: U distinct ids of a step, A ids to admit, T buckets touched, S slots per bucket
(Sw of them for ids: one less when the bucket keeps an "unknown" row), K candidates.
"""

from __future__ import annotations

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
    """[T, Sw] int64, a new id takes the lowest first: a free slot (its position j), then an
    evictable one ((lfu score bits | lru/ttl last use) + 1, shifted past j: lowest score or
    oldest use first, ties to the lower position), never a `busy` one (used this step) nor,
    under ttl, one used within the last ttl_steps steps (INT64_MAX). Inputs are [T, Sw]: each
    slot's id (-1 free), LFU score (fp32 >= 0: its bits order like it), last use step."""
    j = torch.arange(slot_id.shape[1], device=slot_id.device).expand_as(slot_id)
    if evict == "lfu":
        level = score.view(torch.int32).long()
    else:
        level = last
    prio = torch.where(slot_id < 0, j, ((level + 1) << 32) | j)
    blocked = busy & (slot_id >= 0)
    if evict == "ttl":
        blocked = blocked | ((slot_id >= 0) & (clock - last <= ttl_steps))
    return prio.masked_fill(blocked, INT64_MAX)


def choose_slots(
    want_bucket: torch.Tensor, prio_of: callable, slots_per_bucket: int
) -> torch.Tensor:
    """[A] the bucket-local slot position each id to admit takes, -1 for none.

    `want_bucket` [A]: each id's local bucket, ids in ascending order (earlier ids come
    first in their bucket). `prio_of(touched [T]) -> [T, Sw]` (slot_priorities of those
    buckets). The i-th id of a bucket takes the i-th lowest priority slot while there are
    slots a new id may take; the rest get none."""
    order = torch.sort(want_bucket, stable=True).indices
    rank = rank_in_bucket(want_bucket, order)
    touched, per = torch.unique_consecutive(want_bucket.index_select(0, order), return_counts=True)
    prio = prio_of(touched)
    k = min(int(per.max()), slots_per_bucket)
    low, pos = torch.topk(prio, k, dim=1, largest=False, sorted=True)
    n_free = (low != INT64_MAX).sum(1)  # slots a new id may take, per touched bucket (<= k)
    row = torch.searchsorted(touched, want_bucket)
    ok = rank < n_free.index_select(0, row)
    got = pos[row, rank.clamp(max=k - 1)]
    return torch.where(ok, got, -1)


def record_uses(score: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor) -> None:
    """LFU: score[slots] += counts (the host cache's use counts, host.policy.record_uses)."""
    host_policy.record_uses(score, slots, counts)


def age(score: torch.Tensor, clock: int, halflife: int) -> None:
    """LFU ageing after step `clock`: halve every score once per `halflife` steps (as the
    host cache's counts, host.policy.age)."""
    host_policy.age(score, clock, halflife)
