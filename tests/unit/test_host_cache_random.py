"""Random sequences of what training does to a host cache, each against the device group.

A seeded generator picks the optimizer, the batch size, the cache size (down to a few rows
more than two batches need, so rows are evicted, written back and reloaded all the time),
the least share of the cache an eviction frees (often more than the misses need: the rest
join the free list) and whether a prefetch admits on the group's background thread (beside
the backward) or on the caller's. Then a sequence of training steps: with or without
prefetching the next batch, whose lookup is handed what the prefetch admitted, with the very
rows tensor prefetched or the same inputs flattened again (by value), now and then one whose
backward is skipped (as `train.nonfinite=skip` does) or whose prefetched batch never comes.
Between steps: evaluation lookups (sized to fit beside the rows still pending: a skipped
backward's, a prefetch's), flushes, stats, warm starts from random counts (which drop a
pending prefetch: its batch is then looked up without it) and checkpoint loads (new values
written into the host rows). After every operation the outputs, and after every flush the
rows and optimizer state, must equal the device group's exactly, and the free-slot list must
match the slot maps. Odd seeds run the Triton kernels and the copy kernel (interpreted),
where the backward reuses the lookup's sort.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridrec.optim import RowWiseAdagrad, SparseAdam, SparseSGD
from hybridrec.sparse.bags import regular_bags
from hybridrec.sparse.fused import FusedEmbedding, LookupInput
from hybridrec.sparse.host import HostCachedEmbedding
from tests.hostcache import SHARDS, assert_free_list, assert_same_rows, group_lookup

OPTIMIZERS = {
    "sgd": lambda: SparseSGD(0.1),
    "rowwise_adagrad": lambda: RowWiseAdagrad(0.1),
    "adam": lambda: SparseAdam(0.01),
}


def skewed_batch(g: torch.Generator, b: int, skew: float) -> list[LookupInput]:
    """b samples: 2 ids of t0 (300 rows), 1 of t1 (100-row shard, mean pooled)."""
    a = (torch.rand(2 * b, generator=g) ** skew * 300).long()
    c = (torch.rand(b, generator=g) ** skew * 100).long()
    return [
        LookupInput(a, regular_bags(b, 2, a.device), b),
        LookupInput(c, regular_bags(b, 1, c.device), b, 1.0),
    ]


def _equal(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.detach(), b.detach()), what


def _load(host: HostCachedEmbedding, ref: FusedEmbedding, g: torch.Generator) -> None:
    """What a checkpoint load does: new values written into the host rows (and the
    reference's), optimizer state non-negative where it must be."""
    for (_, hw, hs), (_, rw, rs) in zip(host.shard_views(), ref.shard_views(), strict=True):
        w = torch.randn(rw.shape, generator=g)
        hw.copy_(w), rw.copy_(w)
        for name in rs:
            v = torch.rand(rs[name].shape, generator=g)
            hs[name].copy_(v), rs[name].copy_(v)


def _run(seed: int, steps: int = 14) -> dict[str, int]:
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    make = OPTIMIZERS[rnd.choice(list(OPTIMIZERS))]
    b = rnd.randint(3, 16)
    skew = rnd.choice([1.0, 2.0, 4.0])
    # the distinct rows of two batches (one pending, one looked up) must fit: 3 ids a sample
    capacity = rnd.randint(2 * 3 * b + 2, 2 * 3 * b + 60)
    copy = "kernel" if seed % 2 else "auto"
    ref = FusedEmbedding(SHARDS, make(), seed=seed)
    host = HostCachedEmbedding(SHARDS, make(), cache_rows=capacity, seed=seed, copy=copy)
    # evictions free more slots than the misses need (they join the free list), or just enough
    host.evict_share = rnd.choice([1 / 64, 0.1, 0.3])
    host.background = rnd.random() < 0.75  # the prefetch's admission on its thread, or here
    batches = [skewed_batch(g, b, skew) for _ in range(steps + 1)]
    ops = {"step": 0, "prefetched": 0, "skipped": 0, "eval": 0, "flush": 0, "warm": 0, "load": 0}
    ops["by value"] = 0
    ahead = None  # (flattened batch, what its prefetch returned), if it is the next batch's
    skipped = False  # the last step's backward did not run: its rows are still protected
    for step in range(steps):
        inputs = batches[step]
        coeff = [torch.randn(b, 8, generator=g) for _ in range(2)]
        want = ref(inputs)
        if ahead is None:
            got = host(inputs)
        elif rnd.random() < 0.5:  # the very rows tensor prefetched
            got = group_lookup(host, *ahead)
        else:  # the same inputs flattened again: equal values, another tensor
            got = group_lookup(host, host.flatten(inputs), ahead[1])
            ops["by value"] += 1
        _equal(got, want, f"seed {seed} step {step}: training lookup")
        ops["step"] += 1
        ahead, pending = None, False
        if rnd.random() < 0.7:  # the trainer's order: prefetch, then the backward
            nxt = batches[step + 1] if rnd.random() < 0.9 else skewed_batch(g, b, skew)  # unused
            flat = host.flatten(nxt)
            prefetched = host.prefetch(flat[0])
            ahead = (flat, prefetched) if nxt is batches[step + 1] else None
            pending = True  # its rows stay cached until the next training lookup
            ops["prefetched"] += 1
        skipped = rnd.random() < 0.1  # a non-finite loss: no backward (rows stay protected)
        if skipped:
            ops["skipped"] += 1
        else:
            sum((o * c).sum() for o, c in zip(want, coeff, strict=True)).backward()
            sum((o * c).sum() for o, c in zip(got, coeff, strict=True)).backward()
        r = rnd.random()
        # an evaluation between steps: as many samples as fit beside the batches pending
        most = (capacity - 3 * b * (skipped + pending)) // 3
        if r < 0.25 and most >= 1:
            with torch.no_grad():
                other = skewed_batch(g, rnd.randint(1, most), rnd.choice([0.5, 1.0, 3.0]))
                _equal(host(other), ref(other), f"seed {seed} step {step}: eval lookup")
            ops["eval"] += 1
        elif r < 0.35:
            assert_same_rows(host, ref)
            ops["flush"] += 1
        elif r < 0.42:
            host.take_stats()
        elif r < 0.47:
            counts = torch.rand(host.num_rows, generator=g) ** 4 * 50
            host.warm_start(counts.floor(), ids_per_step=3.0 * b)
            ahead = None  # the cache starts again: the prefetch is dropped
            ops["warm"] += 1
        elif r < 0.52:
            _load(host, ref, g)
            ops["load"] += 1
        assert_free_list(host)
    assert_same_rows(host, ref)
    return ops


@pytest.mark.parametrize("seed", range(24))
def test_random_training_sequences_equal_the_device_group(seed, monkeypatch):
    if seed % 2:  # Triton kernels and the copy kernel, in the CPU interpreter
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops = _run(seed)
    assert ops["step"] == 14


def test_the_random_sequences_cover_every_operation():
    """Over the seeds above, every kind of operation happens (so none is silently unused)."""
    total: dict[str, int] = {}
    for seed in range(0, 24, 2):  # the torch-kernel half: fast
        for k, v in _run(seed).items():
            total[k] = total.get(k, 0) + v
    assert all(v > 0 for v in total.values()), total
