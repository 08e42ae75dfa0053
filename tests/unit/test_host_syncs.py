"""Host syncs of a host group, counted on the CPU: an admission reads the device once (twice
while the cache fills), the training lookup of the rows just prefetched takes the prefetch's
slots with no sort and no read, the backward reuses the admission's sort, and with prefetch
the main thread never reads the device. Each case still trains as the device group, bit for
bit.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

import hybridrec
from hybridrec.optim import RowWiseAdagrad, SparseAdam, SparseSGD
from hybridrec.sparse.fused import FusedEmbedding
from hybridrec.sparse.host import HostCachedEmbedding
from tests.unit.test_host_cache import BATCH, SHARDS, _assert_free_list, _assert_same, _batch, _step

# Under the interpreter both groups run the Triton kernels, and both dedupe without a host
# sync (fixed tiles of sorted ids): the same sums in the same order, bit for bit.
TRITON_TOL = {"rtol": 0, "atol": 0}


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_backward_dedupes_with_the_admissions_sort(interpreter, monkeypatch, prefetch):
    """The backward's dedupe sorts the very rows the lookup's admission sorted (or the
    prefetch's, for the rows it admitted): a host group takes that sort instead of sorting
    again, and still trains as the device group, bit for bit."""
    from hybridrec.kernels import segment

    calls = []
    real = segment.sorted_segments
    monkeypatch.setattr(segment, "sorted_segments", lambda r: calls.append(1) or real(r))
    ref = FusedEmbedding(SHARDS, SparseAdam(0.01), seed=3)
    host = HostCachedEmbedding(SHARDS, SparseAdam(0.01), cache_rows=2 * 3 * BATCH + 5, seed=3)
    g = torch.Generator().manual_seed(0)
    flat = [host.flatten(_batch(g)) for _ in range(6)]
    for step, (rows, bags, scale, sizes) in enumerate(flat):
        coeff = torch.randn(sum(sizes), 8, generator=g)
        out_ref = ref.lookup(rows, bags, scale, sum(sizes))
        calls.clear()
        (out_ref * coeff).sum().backward()
        assert calls == [1]  # the device group sorts in its backward
        out = host.lookup(rows, bags, scale, sum(sizes))
        if prefetch and step + 1 < len(flat):
            host.prefetch(flat[step + 1][0])
        calls.clear()
        (out * coeff).sum().backward()
        assert calls == []
        assert torch.equal(out.detach(), out_ref.detach())
    assert host.take_stats().rows_written > 0
    _assert_same(host, ref)


def test_with_prefetch_the_main_thread_never_reads_the_device(interpreter):
    """A prefetch's admission (its one read of the device included) and its row moves run
    on the group's background thread. So in a steady step the main thread, which queues the
    device's work, reads nothing: the lookup takes the prefetched slots, prefetch() only
    hands the rows over, the backward dedupes and updates without a read (Triton's padded
    dedupe, interpreted here as on CUDA; the staged copies run on the thread)."""
    host = HostCachedEmbedding(
        SHARDS, RowWiseAdagrad(0.1), cache_rows=2 * 3 * BATCH + 5, seed=3, copy="staged"
    )
    host.background = True  # as on CUDA
    ref = FusedEmbedding(SHARDS, RowWiseAdagrad(0.1), seed=3)
    g = torch.Generator().manual_seed(0)
    flat = [host.flatten(_batch(g)) for _ in range(8)]
    counts = []
    for step, (rows, bags, scale, sizes) in enumerate(flat[:-1]):
        grad = torch.randn(sum(sizes), 8, generator=g)
        with _HostReads() as reads:
            out = host.lookup(rows, bags, scale, sum(sizes))
            host.prefetch(flat[step + 1][0])
            host.apply_gradient(rows, bags, scale, grad)
        counts.append(len(reads.calls))
        assert torch.equal(out, ref.lookup(rows, bags, scale, sum(sizes)).detach())
        ref.apply_gradient(rows, bags, scale, grad)
    assert counts[0] > 0 and counts[1:] == [0] * (len(counts) - 1), (counts, reads.calls)
    assert host.take_stats().rows_written > 0  # it evicted dirty rows meanwhile
    _assert_same(host, ref)


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


@pytest.mark.parametrize("evict_between", [False, True])
def test_a_lookup_of_the_rows_just_prefetched_reuses_their_slots(calls, evict_between):
    """The training lookup of the very rows tensor the last prefetch admitted takes that
    prefetch's slots: no sort, no host sync. Not when an admission evicted rows in between
    (an evaluation's lookup, say): then it admits them again. Training equals the device
    group either way."""
    ref = FusedEmbedding(SHARDS, RowWiseAdagrad(0.1), seed=3)
    host = HostCachedEmbedding(SHARDS, RowWiseAdagrad(0.1), cache_rows=2 * 3 * BATCH + 5, seed=3)
    g = torch.Generator().manual_seed(0)
    flat = [host.flatten(_batch(g)) for _ in range(6)]
    reused, expected = [], []
    for step, (rows, bags, scale, sizes) in enumerate(flat):
        coeff = torch.randn(sum(sizes), 8, generator=g)
        out_ref = ref.lookup(rows, bags, scale, sum(sizes))
        (out_ref * coeff).sum().backward()
        calls.clear()
        out = host.lookup(rows, bags, scale, sum(sizes))
        reused.append(not calls)
        if step + 1 < len(flat):
            host.prefetch(flat[step + 1][0])
            host._wait()  # the prefetch's admission (on the group's thread) has run
            evictions = host.evictions
            if evict_between:  # an eval lookup of rows never seen: once full, the cache evicts
                with torch.no_grad():
                    other = torch.arange(300 + 10 * step, 300 + 10 * step + 2 * BATCH)
                    host.lookup(other, torch.arange(other.numel()), None, other.numel())
            expected.append(host.evictions == evictions)
        (out * coeff).sum().backward()
        assert torch.equal(out.detach(), out_ref.detach())
        _assert_free_list(host)
    assert not reused[0] and reused[1:] == expected
    assert all(expected) != evict_between  # with evaluations, some did evict
    _assert_same(host, ref)


def test_a_forward_of_the_inputs_just_prefetched_reuses_their_slots(calls):
    """On several ranks prefetch() flattens the distributed inputs and the forward flattens
    the same inputs again: it gets the same rows tensor back, so it takes the prefetch's
    slots too (no sort, no sync). New inputs are flattened anew."""
    ref = FusedEmbedding(SHARDS, SparseSGD(0.1), seed=3)
    host = HostCachedEmbedding(SHARDS, SparseSGD(0.1), cache_rows=2 * 3 * BATCH + 5, seed=3)
    g = torch.Generator().manual_seed(0)
    batches = [_batch(g) for _ in range(6)]
    reused = []
    for step, inputs in enumerate(batches):
        coeff = [torch.randn(BATCH, 8, generator=g) for _ in range(2)]
        out_ref = _step(ref, inputs, coeff)
        calls.clear()
        out = host(inputs)
        reused.append(not calls)
        if step + 1 < len(batches):
            host.prefetch(host.flatten(batches[step + 1])[0])
        sum((o * c).sum() for o, c in zip(out, coeff, strict=True)).backward()
        for a, b in zip(out, out_ref, strict=True):
            assert torch.equal(a.detach(), b)
    assert reused == [False] + [True] * (len(batches) - 1)
    assert host.prefetched_lookups == len(batches) - 1
    _assert_same(host, ref)


TORCH_ROOT = str(Path(torch.__file__).parent)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls from hybridrec's code that make a CUDA program wait for the device
    (values read on the host, sizes that depend on data: nonzero, unique, boolean masks)."""

    READS = {
        torch.Tensor.tolist,
        torch.Tensor.item,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.nonzero,
        torch.nonzero,
        torch.unique,
        torch.Tensor.unique,
        torch.unique_consecutive,
        torch.masked_select,
        torch.Tensor.masked_select,
        torch.Tensor.cpu,
    }

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.root = str(Path(hybridrec.__file__).parent)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        frame = sys._getframe(1)
        while frame.f_code.co_filename.startswith(TORCH_ROOT):  # torch's own wrappers
            frame = frame.f_back
        if frame.f_code.co_filename.startswith(self.root):  # hybridrec's call, not triton's
            read = func in self.READS
            if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
                read = isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool
            if read:
                where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                self.calls.append(f"{func.__name__} at {where}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_host_step_reads_the_device_once(interpreter, prefetch):
    """What a CUDA step would wait for, counted on the CPU (kernels interpreted, kernel
    copies, a cache that evicts every step): an evicting admission reads the device once
    (its sizes and how many slots may go, together, once misses outnumber free slots); the
    backward never; a lookup of the rows just prefetched never. So one read per step, two
    at most while the cache fills."""
    host = HostCachedEmbedding(
        SHARDS, RowWiseAdagrad(0.1), cache_rows=2 * 3 * BATCH + 5, seed=3, copy="kernel"
    )
    g = torch.Generator().manual_seed(0)
    flat = [host.flatten(_batch(g)) for _ in range(8)]
    counts = []
    for step, (rows, bags, scale, sizes) in enumerate(flat[:-1]):
        with _HostReads() as reads:
            out = host.lookup(rows, bags, scale, sum(sizes))
            if prefetch:
                host.prefetch(flat[step + 1][0])
            # what the lookup's backward runs (called here: modes are off inside autograd)
            host.apply_gradient(rows, bags, scale, torch.randn(out.shape, generator=g))
        counts.append(len(reads.calls))
        assert len(reads.calls) <= 2, reads.calls
    assert counts[2:] == [1] * len(counts[2:]), counts
    assert host.take_stats().rows_written > 0  # it evicted dirty rows: the costly path ran
