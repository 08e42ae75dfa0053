"""The host cache's policy (hybridrec.sparse.host.policy) as plain tensor functions: no cache
object, no stream, no CUDA. Scores (LFU with ageing), the eviction choice, the warm start's
rows, counts and expected hit rate."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrec.sparse.host import policy

INF = float("inf")


@pytest.mark.parametrize(
    "rows",
    [[5, 3, 5, 0, 3, 3, 9], [4, 4, 4], [7], [2, 1, 0], list(range(40, 0, -3)) * 2, []],
)
def test_unique_padded_equals_torch_unique(rows):
    """The sync-free unique: torch.unique's distinct rows, inverse and counts in the first U
    entries; past U the largest row with count 0."""
    t = torch.tensor(rows, dtype=torch.int64)
    uniq, inverse, counts, n = policy.unique_padded(t)
    want, want_inverse, want_counts = torch.unique(t, return_inverse=True, return_counts=True)
    u = int(n)
    assert u == want.numel() and uniq.shape == counts.shape == inverse.shape == t.shape
    assert torch.equal(uniq[:u], want) and torch.equal(counts[:u], want_counts)
    assert torch.equal(inverse, want_inverse)
    if rows:
        assert bool((uniq[u:] == max(rows)).all()) and bool((counts[u:] == 0).all())


def test_slot_scores_read_each_slots_row_count_and_free_slots_score_zero():
    freq = torch.tensor([0.5, 7.0, 2.0, 9.0, 1.0])
    row_of_slot = torch.tensor([3, -1, 1, 4])
    assert policy.slot_scores(freq, row_of_slot).tolist() == [9.0, 0.0, 7.0, 1.0]


def test_uses_are_counted_per_distinct_row():
    freq = torch.zeros(6)
    policy.record_uses(freq, torch.tensor([1, 4]), torch.tensor([3, 1]))
    policy.record_uses(freq, torch.tensor([4, 5]), torch.tensor([2, 1]))
    assert freq.tolist() == [0.0, 3.0, 0.0, 0.0, 3.0, 1.0]


def test_ageing_halves_every_count_once_per_half_life():
    freq = torch.tensor([8.0, 2.0, 0.0])
    seen = []
    for lookup in range(1, 10):
        policy.age(freq, lookup, age_every=3)
        seen.append(freq[0].item())
    assert seen == [8.0, 8.0, 4.0, 4.0, 4.0, 2.0, 2.0, 2.0, 1.0]
    assert freq.tolist() == [1.0, 0.25, 0.0]  # every row, cached or not


def test_a_steady_rows_count_settles_around_uses_times_the_ageing_window():
    """Used u times per lookup, a row's count cycles between k*u (just after a halving) and
    (2k - 1)*u, just before one (k = age_every): the warm start's level u * k / ln 2 lies
    inside that band."""
    k, u = 10, 3.0
    freq = torch.zeros(1)
    low, high = INF, 0.0
    for lookup in range(1, 20 * k + 1):
        policy.record_uses(freq, torch.tensor([0]), torch.tensor([u]))
        policy.age(freq, lookup, k)
        if lookup > 10 * k:
            low, high = min(low, freq.item()), max(high, freq.item())
    assert low == pytest.approx(k * u, rel=1e-3) and high == pytest.approx(
        (2 * k - 1) * u, rel=1e-3
    )
    assert policy.ageing_window(k) == k / math.log(2)
    assert low < u * policy.ageing_window(k) < high


def test_eviction_scores_mask_free_and_kept_slots():
    score = torch.tensor([5.0, 1.0, 0.0, 3.0, 2.0, 4.0])
    free = torch.tensor([2])
    keep = policy.kept(torch.tensor([4, -1, -1]), torch.tensor([0]))  # -1: a miss, ignored
    masked = policy.eviction_scores(score, free, keep)
    assert masked.tolist() == [INF, 1.0, INF, 3.0, INF, 4.0]
    assert int(policy.evictable(masked)) == 3
    assert policy.kept(torch.tensor([1]), None).tolist() == [1]


def test_victims_are_the_lowest_scores_outside_protected_slots():
    C = 64
    score = torch.arange(C, dtype=torch.float32).flip(0)  # slot 63 scores lowest
    protected = torch.tensor([63, 62, 10])
    masked = policy.eviction_scores(score, torch.tensor([], dtype=torch.int64), protected)
    n = int(policy.evictable(masked))
    assert n == C - 3
    victims = policy.choose_victims(masked, short=2, n_evictable=n, share=0.0)
    assert sorted(victims.tolist()) == [60, 61]  # the two lowest that may go
    assert not set(victims.tolist()) & set(protected.tolist())


@pytest.mark.parametrize(
    "short,share,n_evictable,want",
    [
        (2, 1 / 64, 61, 2),  # share of 64 slots is 1: the need decides
        (2, 1 / 8, 61, 8),  # in bulk: at least share of the cache
        (20, 1 / 8, 61, 20),  # ... or what is needed, if more
        (5, 0.5, 6, 6),  # never more than may go
        (7, 0.5, 6, None),  # fewer may go than are needed
    ],
)
def test_an_eviction_takes_at_least_its_share_and_never_more_than_may_go(
    short, share, n_evictable, want
):
    C = 64
    score = torch.rand(C, generator=torch.Generator().manual_seed(0))
    finite = torch.randperm(C, generator=torch.Generator().manual_seed(1))[:n_evictable]
    masked = torch.full((C,), INF)
    masked[finite] = score[finite]
    victims = policy.choose_victims(masked, short, n_evictable, share)
    if want is None:
        assert victims is None
        return
    assert victims.numel() == want
    assert set(victims.tolist()) <= set(finite.tolist())
    worst_kept = masked[victims].max()  # every evictable slot not taken scores at least as high
    rest = torch.ones(C, dtype=torch.bool)
    rest[victims] = False
    assert bool((masked[rest] >= worst_kept).all())


def test_warm_start_picks_the_most_frequent_rows_in_row_order():
    frequency = torch.zeros(12)
    frequency[[9, 2, 5, 7]] = torch.tensor([10.0, 3.0, 8.0, 1.0])
    assert policy.warm_size(frequency, capacity=3) == 3
    assert policy.warm_size(frequency, capacity=10) == 4  # only rows with a count
    assert policy.warm_size(torch.zeros(12), capacity=10) == 0
    freq = policy.warm_counts(frequency, ids_per_step=4.0, age_every=100)
    assert policy.warm_rows(freq, 3).tolist() == [2, 5, 9]  # ascending: sequential reads


def test_warm_counts_are_expected_uses_per_step_times_the_window():
    frequency = torch.tensor([6.0, 0.0, 3.0, 1.0], dtype=torch.float64)
    freq = policy.warm_counts(frequency, ids_per_step=20.0, age_every=50)
    window = 50 / math.log(2)
    assert freq.dtype == torch.float32
    want = (frequency / frequency.sum() * 20.0 * window).float()
    torch.testing.assert_close(freq, want)
    assert float(freq.sum()) == pytest.approx(20.0 * window, rel=1e-6)


def test_warm_hits_is_the_chance_each_row_is_in_a_step_summed():
    """Ids drawn by these counts, ids_per_step a step: row r is among a step's ids with
    chance 1 - e^-(p_r * ids_per_step); warm_hits sums that over the cached rows and all."""
    g = torch.Generator().manual_seed(0)
    frequency = torch.rand(1000, generator=g) ** 4
    ids, age_every = 300.0, 1000
    freq = policy.warm_counts(frequency, ids, age_every)
    rows = policy.warm_rows(freq, 100)
    cached, total = policy.warm_hits(freq, rows, age_every)
    p = frequency.double() / frequency.double().sum()
    present = 1 - torch.exp(-p * ids)
    assert cached == pytest.approx(float(present[rows].sum()), rel=1e-5)
    assert total == pytest.approx(float(present.sum()), rel=1e-5)
    # the most frequent rows are the best fixed set that size
    other = torch.randperm(1000, generator=g)[:100]
    assert policy.warm_hits(freq, other, age_every)[0] <= cached
