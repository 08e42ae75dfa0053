"""Host syncs of a host group, counted on the CPU (tests.syncs.SyncRecorder): an admission
reads the device once (twice while the cache fills); the lookup of a prefetched batch, handed
what its prefetch admitted, takes those slots with no sort and no read, and its backward
reuses the lookup's sort; with prefetch on the group's thread the main thread never reads the
device. The hand-off is by value: a lookup of equal rows takes it, a mismatched one is an
error. Each case still trains as the device group, bit for bit.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hybridrec.optim import RowWiseAdagrad, SparseAdam, SparseSGD
from hybridrec.sparse.fused import FusedEmbedding
from hybridrec.sparse.host import HostCachedEmbedding
from tests.hostcache import (
    BATCH,
    SHARDS,
    assert_free_list,
    assert_same_rows,
    group_lookup,
    skewed_batch,
)
from tests.syncs import SyncRecorder, unrecorded_launches


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    unrecorded_launches(monkeypatch)


def _groups(opt, cache_rows: int = 2 * 3 * BATCH + 5, **kw):  # noqa: ANN001, ANN003, ANN202
    return FusedEmbedding(SHARDS, opt(), seed=3), HostCachedEmbedding(
        SHARDS, opt(), cache_rows=cache_rows, seed=3, **kw
    )


def _train(out: list[torch.Tensor], coeff: list[torch.Tensor]) -> None:
    sum((o * c).sum() for o, c in zip(out, coeff, strict=True)).backward()


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_backward_dedupes_with_the_lookups_sort(interpreter, monkeypatch, prefetch):
    """The backward's dedupe sorts the very rows the lookup's admission sorted (or the
    prefetch's, for the rows it admitted): a host group's lookup hands that sort to its own
    backward (through autograd's context) instead of sorting again, and still trains as the
    device group, bit for bit."""
    from hybridrec.kernels import segment

    calls = []
    real = segment.sorted_segments
    monkeypatch.setattr(segment, "sorted_segments", lambda r: calls.append(1) or real(r))
    ref, host = _groups(lambda: SparseAdam(0.01))
    g = torch.Generator().manual_seed(0)
    flat = [host.flatten(skewed_batch(g)) for _ in range(6)]
    ahead = None
    for step, batch in enumerate(flat):
        coeff = [torch.randn(BATCH, 8, generator=g) for _ in range(2)]
        out_ref = group_lookup(ref, batch)
        calls.clear()
        _train(out_ref, coeff)
        assert calls == [1]  # the device group sorts in its backward
        out = group_lookup(host, batch, ahead)
        ahead = host.prefetch(flat[step + 1][0]) if prefetch and step + 1 < len(flat) else None
        calls.clear()
        _train(out, coeff)
        assert calls == []
        for a, b in zip(out, out_ref, strict=True):
            assert torch.equal(a.detach(), b.detach())
    assert host.take_stats().rows_written > 0
    assert_same_rows(host, ref)


def test_with_prefetch_the_main_thread_never_reads_the_device(interpreter):
    """A prefetch's admission (its one read of the device included) and its row moves run
    on the group's background thread. So in a steady step the main thread, which queues the
    device's work, reads nothing: the lookup takes the prefetched slots, prefetch() only
    hands the rows over, the backward dedupes and updates without a read (Triton's padded
    dedupe, interpreted here as on CUDA; the staged copies run on the thread)."""
    ref, host = _groups(lambda: RowWiseAdagrad(0.1), copy="staged")
    host.background = True  # as on CUDA
    g = torch.Generator().manual_seed(0)
    flat = [host.flatten(skewed_batch(g)) for _ in range(8)]
    counts, ahead = [], None
    for step, batch in enumerate(flat[:-1]):
        coeff = [torch.randn(BATCH, 8, generator=g) for _ in range(2)]
        with SyncRecorder() as rec:
            out = group_lookup(host, batch, ahead)
            ahead = host.prefetch(flat[step + 1][0])
            _train(out, coeff)
        counts.append(len(rec.syncs))  # on this thread: the recorders are per thread
        out_ref = group_lookup(ref, batch)
        _train(out_ref, coeff)
        for a, b in zip(out, out_ref, strict=True):
            assert torch.equal(a.detach(), b.detach())
    assert counts[0] > 0 and counts[1:] == [0] * (len(counts) - 1), (counts, rec.syncs)
    assert host.take_stats().rows_written > 0  # it evicted dirty rows meanwhile
    assert_same_rows(host, ref)


@pytest.fixture
def calls(monkeypatch):
    """A list with an entry per sorted admission (unique_padded call) of any host group on
    this thread (a prefetch's admission runs on the group's background thread)."""
    from hybridrec.sparse.host import policy

    made = []
    real = policy.unique_padded

    def counted(*a):  # noqa: ANN002, ANN202
        if threading.current_thread() is threading.main_thread():
            made.append(1)
        return real(*a)

    monkeypatch.setattr(policy, "unique_padded", counted)
    return made


@pytest.mark.parametrize("evaluate", [False, True])
def test_a_prefetched_batch_keeps_its_slots_until_its_lookup(calls, evaluate):
    """The lookup handed what the last prefetch admitted takes its slots: no sort, no host
    sync. Those slots are kept from eviction until then: an evaluation in between (lookups
    of rows never seen, which evict) leaves them, so the lookup still takes them. Training
    equals the device group either way."""
    ref, host = _groups(lambda: RowWiseAdagrad(0.1))
    g = torch.Generator().manual_seed(0)
    flat = [host.flatten(skewed_batch(g)) for _ in range(6)]
    reused, evicted, ahead = [], 0, None
    for step, batch in enumerate(flat):
        coeff = [torch.randn(BATCH, 8, generator=g) for _ in range(2)]
        out_ref = group_lookup(ref, batch)
        _train(out_ref, coeff)
        calls.clear()
        out = group_lookup(host, batch, ahead)
        reused.append(not calls)
        ahead = host.prefetch(flat[step + 1][0]) if step + 1 < len(flat) else None
        _train(out, coeff)
        for a, b in zip(out, out_ref, strict=True):
            assert torch.equal(a.detach(), b.detach())
        if evaluate and ahead is not None:  # between steps, as the trainer evaluates
            before = host.evictions
            with torch.no_grad():
                other = torch.arange(300 + 10 * step, 300 + 10 * step + 2 * BATCH)
                host.lookup(other, torch.arange(other.numel()), None, other.numel())
            evicted += host.evictions - before
        assert_free_list(host)
    assert reused == [False] + [True] * (len(flat) - 1)
    assert host.prefetched_lookups == len(flat) - 1
    assert (evicted > 0) == evaluate  # the evaluations evicted, never the prefetched rows
    assert_same_rows(host, ref)


def test_the_hand_off_is_by_value(calls):
    """The lookup takes what the prefetch admitted for rows of equal values in another
    tensor (inputs flattened again), not only for the very tensor prefetched: no sort, no
    sync, the device group's results."""
    ref, host = _groups(lambda: SparseSGD(0.1))
    g = torch.Generator().manual_seed(0)
    batches = [skewed_batch(g) for _ in range(6)]
    reused, ahead = [], None
    for step, inputs in enumerate(batches):
        coeff = [torch.randn(BATCH, 8, generator=g) for _ in range(2)]
        out_ref = group_lookup(ref, ref.flatten(inputs))
        _train(out_ref, coeff)
        calls.clear()
        out = group_lookup(host, host.flatten(inputs), ahead)  # a new rows tensor, equal values
        reused.append(not calls)
        if step + 1 < len(batches):
            ahead = host.prefetch(host.flatten(batches[step + 1])[0])
        _train(out, coeff)
        for a, b in zip(out, out_ref, strict=True):
            assert torch.equal(a.detach(), b.detach())
    assert reused == [False] + [True] * (len(batches) - 1)
    assert_same_rows(host, ref)


def test_a_mismatched_hand_off_is_an_error():
    """A lookup handed a prefetch that is not this cache's outstanding one of the same rows
    raises, never quietly admits again: another group's, one already looked up, one replaced
    by a later prefetch, dropped by a training lookup of other rows or by a warm start, or of
    another size. One of the same size but other rows (not checkable without a sync) is
    noted on the device and raised by the next take_stats(), like the eviction guard."""
    g = torch.Generator().manual_seed(0)
    flat = [FusedEmbedding(SHARDS, None).flatten(skewed_batch(g)) for _ in range(3)]
    a, b, c = flat
    other = HostCachedEmbedding(SHARDS, SparseSGD(0.1), cache_rows=200, seed=3)
    not_held = "a lookup was handed a prefetch this cache does not hold"

    def fresh() -> HostCachedEmbedding:
        host = HostCachedEmbedding(SHARDS, SparseSGD(0.1), cache_rows=200, seed=3)
        group_lookup(host, c)  # a training lookup: rows cached, backward pending
        return host

    host = fresh()
    with pytest.raises(RuntimeError, match=not_held):
        group_lookup(host, a, other.prefetch(a[0]))
    p = host.prefetch(a[0])
    group_lookup(host, a, p)
    with pytest.raises(RuntimeError, match=not_held):
        group_lookup(host, a, p)  # used already
    p, q = host.prefetch(a[0]), host.prefetch(b[0])
    with pytest.raises(RuntimeError, match=not_held):
        group_lookup(host, a, p)  # replaced by q
    group_lookup(host, b, q)
    p = host.prefetch(a[0])
    group_lookup(host, b)  # a training lookup of other rows: a's batch never comes
    with pytest.raises(RuntimeError, match=not_held):
        group_lookup(host, a, p)
    p = host.prefetch(a[0])
    host.warm_start(torch.ones(host.num_rows), ids_per_step=48)
    with pytest.raises(RuntimeError, match=not_held):
        group_lookup(host, a, p)
    p = host.prefetch(a[0])
    short = (a[0][:-1], a[1][:-1], a[2], a[3])
    with pytest.raises(RuntimeError, match=r"lookup of 47 ids was handed the prefetch of 48"):
        group_lookup(host, short, p)

    host = fresh()
    p = host.prefetch(a[0])
    with torch.no_grad():  # an evaluation between: the prefetch stays
        group_lookup(host, b)
    group_lookup(host, (a[0].flip(0), *a[1:]), p)  # same size, other order: other rows
    with pytest.raises(RuntimeError, match="handed the prefetch of other rows"):
        host.take_stats()


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_host_step_reads_the_device_once(interpreter, prefetch):
    """What a CUDA step would wait for, counted on the CPU (kernels interpreted, kernel
    copies, a cache that evicts every step): an evicting admission reads the device once
    (its sizes and how many slots may go, together, once misses outnumber free slots); the
    backward never; a lookup of a prefetched batch never. So one read per step, two at most
    while the cache fills, and none anywhere else."""
    ref, host = _groups(lambda: RowWiseAdagrad(0.1), copy="kernel")
    g = torch.Generator().manual_seed(0)
    flat = [host.flatten(skewed_batch(g)) for _ in range(8)]
    counts, ahead = [], None
    for step, batch in enumerate(flat[:-1]):
        coeff = [torch.randn(BATCH, 8, generator=g) for _ in range(2)]
        with SyncRecorder() as rec:
            out = group_lookup(host, batch, ahead)
            if prefetch:
                ahead = host.prefetch(flat[step + 1][0])
            _train(out, coeff)
        counts.append(len(rec.syncs))
        assert not rec.unexpected(), rec.unexpected()
        assert len(rec.syncs) <= 2, rec.syncs
        _train(group_lookup(ref, batch), coeff)
    assert counts[2:] == [1] * len(counts[2:]), counts
    assert host.take_stats().rows_written > 0  # it evicted dirty rows: the costly path ran
    assert_same_rows(host, ref)
