"""The host-memory group with a device cache equals the all-on-device group, bit for bit.

The caches here are tiny (a few rows more than one batch needs), so rows are evicted, written
back and reloaded on every step; the comparisons are exact (torch.equal), because the cache
only moves rows: every update runs the same kernels on the same values.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridrec.optim import RowWiseAdagrad, SparseAdam, SparseSGD
from hybridrec.sparse.fused import FusedEmbedding, LookupInput
from hybridrec.sparse.host import (
    CacheTooSmallError,
    HostCachedEmbedding,
    HostMemoryError,
    check_host_memory,
)
from hybridrec.types import Pooling, ShardSpec, StateKind, TableConfig
from tests.hostcache import (
    BATCH,
    SHARDS,
    assert_free_list,
    assert_same_rows,
    group_lookup,
    group_shards,
    row_optimizers,
    skewed_batch,
    train_step,
)

T0 = TableConfig("t0", num_rows=300, dim=8, hotness=2)
T1 = TableConfig("t1", num_rows=120, dim=8, hotness=1, pooling=Pooling.MEAN)


def test_an_update_of_an_evicted_row_is_an_error_at_the_next_stats():
    """The guard against a row evicted between its lookup and its update (a bug) costs no
    host sync: it is noted on the device and raised by take_stats (and flush), and the
    update went to a valid slot meanwhile."""
    host = HostCachedEmbedding(SHARDS, SparseSGD(0.1), cache_rows=3 * BATCH, seed=3)
    inputs = skewed_batch(torch.Generator().manual_seed(0))
    out = host(inputs)
    rows = host.flatten(inputs)[0]
    host.slot_of[rows[0]] = -1  # what the bug would do
    sum(o.sum() for o in out).backward()
    with pytest.raises(RuntimeError, match="evicted between its lookup and its update"):
        host.take_stats()
    with pytest.raises(RuntimeError, match="evicted between its lookup and its update"):
        host.flush()


@pytest.mark.parametrize("width", [8, 1])
@pytest.mark.parametrize("opt", list(row_optimizers()))
@pytest.mark.parametrize("prefetch", ["none", "background", "admit here"])
def test_tiny_cache_equals_device_group(opt, prefetch, width):
    """With prefetch admitting on the group's thread (the default) or on this one (rows
    still moving on the group's thread), its admission handed to the lookup of its rows, or
    without prefetch; tables of width 8 and 1."""
    make = row_optimizers()[opt]
    shards = group_shards(width)
    ref = FusedEmbedding(shards, make(), seed=3)
    host = HostCachedEmbedding(shards, make(), cache_rows=2 * 3 * BATCH + 5, seed=3)
    host.background = prefetch == "background"
    assert torch.equal(host.weight, ref.weight)  # same initial values
    g = torch.Generator().manual_seed(0)
    batches = [skewed_batch(g) for _ in range(12)]
    coeffs = [[torch.randn(BATCH, width, generator=g) for _ in range(2)] for _ in batches]
    ahead = None
    for step, (inputs, coeff) in enumerate(zip(batches, coeffs, strict=True)):
        out_ref = train_step(ref, inputs, coeff)
        out = group_lookup(host, host.flatten(inputs), ahead)
        ahead = None
        if prefetch != "none" and step + 1 < len(batches):  # the trainer's order: before backward
            ahead = host.prefetch(host.flatten(batches[step + 1])[0])
        sum((o * c).sum() for o, c in zip(out, coeff, strict=True)).backward()
        for a, b in zip(out, out_ref, strict=True):
            assert torch.equal(a.detach(), b)
        assert_free_list(host)
    stats = host.take_stats()
    assert stats.rows_written > 0 and stats.rows_loaded > host.capacity  # it really evicted
    assert 0 < stats.hits < stats.rows_requested
    assert host.prefetched_lookups == (0 if prefetch == "none" else len(batches) - 1)
    for name, kind in make().state_spec().items():  # element-wise state [R, D] and [C, D]
        if kind == StateKind.ELEMENT:
            assert host.state()[name].shape == host.weight.shape, name
            assert host.cache_state()[name].shape == host.cache_weight.shape, name
    assert_same_rows(host, ref)


def test_eval_lookups_and_checkpoint_views_stay_exact():
    ref = FusedEmbedding(SHARDS, RowWiseAdagrad(0.1), seed=1)
    host = HostCachedEmbedding(SHARDS, RowWiseAdagrad(0.1), cache_rows=60, seed=1)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        inputs, coeff = skewed_batch(g), [torch.randn(BATCH, 8, generator=g) for _ in range(2)]
        train_step(ref, inputs, coeff)
        train_step(host, inputs, coeff)
        with torch.no_grad():  # an eval lookup in between admits rows too
            probe = skewed_batch(g)
            for a, b in zip(host(probe), ref(probe), strict=True):
                assert torch.equal(a, b)
    # a checkpoint load writes into the views: the cached copies must follow
    views = host.shard_views()
    views[0][1].mul_(0.5)
    ref.shard_views()[0][1].mul_(0.5)
    inputs = skewed_batch(g)
    with torch.no_grad():
        for a, b in zip(host(inputs), ref(inputs), strict=True):
            assert torch.equal(a, b)
    assert_same_rows(host, ref)


def test_warm_start_loads_the_most_frequent_rows():
    host = HostCachedEmbedding(SHARDS, SparseSGD(0.1), cache_rows=40, seed=0)
    freq = torch.zeros(host.num_rows)
    freq[[5, 7, 250, 310]] = torch.tensor([10.0, 3.0, 8.0, 1.0])
    assert host.warm_start(freq, ids_per_step=48) == 4
    assert sorted(host.row_of_slot[:4].tolist()) == [5, 7, 250, 310]
    assert torch.equal(host.cache_weight[:4], host.weight[host.row_of_slot[:4]])
    ids = torch.tensor([5, 7, 250, 5])
    host(
        [
            LookupInput(ids, torch.arange(4), 4),
            LookupInput(torch.tensor([10]), torch.tensor([0]), 1),
        ]
    )
    stats = host.take_stats()
    assert (stats.hits, stats.rows_requested) == (4, 4)  # 310 (row 10 of t1) was warm too


def test_warm_started_cache_trains_exactly_like_the_device_group():
    g = torch.Generator().manual_seed(5)
    ref = FusedEmbedding(SHARDS, RowWiseAdagrad(0.1), seed=3)
    host = HostCachedEmbedding(SHARDS, RowWiseAdagrad(0.1), cache_rows=48, seed=3)
    host.warm_start(torch.rand(host.num_rows, generator=g) ** 4, ids_per_step=3 * BATCH)
    for _ in range(6):
        inputs = skewed_batch(g)
        coeff = [torch.randn(BATCH, 8, generator=g) for _ in inputs]
        for a, b in zip(
            train_step(host, inputs, coeff), train_step(ref, inputs, coeff), strict=True
        ):
            assert torch.equal(a, b)
    assert host.take_stats().rows_written > 0  # it evicted dirty rows on the way
    assert_same_rows(host, ref)


def test_evicted_rows_keep_their_use_count_and_one_off_rows_go_first():
    """Every row's aged use count (freq) survives eviction, and warm-start counts are on the
    scale lookups reach (expected uses per step x the ageing window): a row used many times
    and evicted, or a warm row, outranks a row met once."""
    t = TableConfig("t", num_rows=100, dim=4)
    group = HostCachedEmbedding([(t, 0, ShardSpec("t", 0, 0, 100, 0, 4))], None, cache_rows=6)

    def look(ids):
        ids = torch.tensor(ids)
        group([LookupInput(ids, torch.arange(ids.numel()), ids.numel())])  # admits

    look([7, 7, 7, 7, 7, 1])
    look([10, 11, 12, 13, 14, 15])  # needs all six slots: 7 is evicted ...
    assert group.slot_of[7] < 0 and group.freq[7] == 5  # ... and keeps its count
    look([7, 20])  # 7 comes back with score 6, 20 with 1
    assert group.score[int(group.slot_of[7])] == 6 and group.score[int(group.slot_of[20])] == 1
    used = group.row_of_slot >= 0
    assert torch.equal(group.score[used], group.freq[group.row_of_slot[used]])
    look([30, 31, 32, 33])  # four evictions among the score-1 rows: 7 stays
    assert group.slot_of[7] >= 0

    freq = torch.zeros(100)
    freq[[3, 4, 5]] = torch.tensor([50.0, 30.0, 20.0])
    group.warm_start(freq, ids_per_step=1.0)  # 0.5, 0.3, 0.2 uses per step: cached
    window = group.age_every / math.log(2)
    torch.testing.assert_close(group.freq[[3, 4, 5]], torch.tensor([0.5, 0.3, 0.2]) * window)
    look([60, 61, 62])  # into the three free slots
    look([63, 64, 65])  # evicts the rows met once (score 1), not the warm rows (score >= 28)
    group.take_stats()
    look([3, 4, 5])
    assert group.take_stats().hits == 3


def test_a_cache_smaller_than_one_batch_is_a_clear_error():
    host = HostCachedEmbedding(SHARDS, SparseSGD(0.1), cache_rows=10, seed=0)
    ids = torch.arange(40)
    with pytest.raises(CacheTooSmallError, match=r"t0, t1: 10 rows cannot hold the 41 distinct"):
        host([LookupInput(ids, ids, 40), LookupInput(torch.tensor([0]), torch.tensor([0]), 1)])


def test_host_memory_is_checked_before_allocating():
    with pytest.raises(
        HostMemoryError, match=r"tables t0 need 2\.00 GiB .* sharding.host_gb is 1\.00"
    ):
        check_host_memory(2 << 30, 1 << 30, "tables t0")
    check_host_memory(1 << 20, None, "small tables")  # fits in free memory


def test_bad_cache_sizes_are_refused():
    with pytest.raises(ValueError, match="cache of 0 rows for a group of 400 rows"):
        HostCachedEmbedding(SHARDS, SparseSGD(0.1), cache_rows=0)


def test_warm_start_states_the_hit_rate_its_rows_give():
    """warm_hits: the chance each row is among a step's ids (1 - e^-uses), summed over the
    cached rows and over all rows. With ids drawn by those counts, the cache (LFU with
    ageing, started from them) then hits nearly that share of each batch's distinct rows:
    the best any fixed set of rows that size does."""
    rows = 20_000
    table = TableConfig("t", num_rows=rows, dim=4, hotness=1)
    g = torch.Generator().manual_seed(0)
    counts = (1.0 / torch.arange(1, rows + 1).double() ** 1.05)[torch.randperm(rows, generator=g)]
    p = counts / counts.sum()
    for cache_rows, n_ids in ((2000, 1000), (1000, 400)):
        host = HostCachedEmbedding(
            [(table, 0, ShardSpec("t", 0, 0, rows, 0, 4))], SparseSGD(0.1), cache_rows, seed=3
        )
        host.warm_start(counts * 1e6, ids_per_step=float(n_ids))
        present = -torch.expm1(-p * n_ids)
        want = float(present[torch.topk(counts, cache_rows).indices].sum() / present.sum())
        cached, total = host.warm_hits
        assert cached / total == pytest.approx(want, rel=1e-4)
        for step in range(300):
            if step == 100:
                host.take_stats()
            ids = torch.multinomial(p, n_ids, replacement=True, generator=g)
            host.lookup(ids, torch.arange(n_ids), None, n_ids).sum().backward()
        st = host.take_stats()
        assert want - 0.04 < st.hits / st.rows_requested < want + 0.01, (cache_rows, want)


class _NeverForeseesEvictions(HostCachedEmbedding):
    """A group that never reads the evictable count with the misses (its guess of the
    misses stays 0): every eviction takes the second sync's path."""

    @property
    def _last_misses(self) -> int:
        return 0

    @_last_misses.setter
    def _last_misses(self, value: int) -> None:
        pass


@pytest.mark.parametrize("group", [HostCachedEmbedding, _NeverForeseesEvictions])
def test_evictions_foreseen_or_not_train_alike(group):
    """Whether the evictable count comes with the first sync (the last admission's misses
    outnumbered the free slots) or after it, training equals the device group."""
    ref = FusedEmbedding(SHARDS, SparseAdam(0.01), seed=3)
    host = group(SHARDS, SparseAdam(0.01), cache_rows=2 * 3 * BATCH + 5, seed=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        inputs = skewed_batch(g)
        coeff = [torch.randn(BATCH, 8, generator=g) for _ in range(2)]
        out_ref = train_step(ref, inputs, coeff)
        out = host(inputs)
        sum((o * c).sum() for o, c in zip(out, coeff, strict=True)).backward()
        for a, b in zip(out, out_ref, strict=True):
            assert torch.equal(a.detach(), b)
        assert_free_list(host)
    assert host.take_stats().rows_written > 0
    assert_same_rows(host, ref)


# -- host memory ----------------------------------------------------------------------------


def test_tables_are_pinned_at_exactly_their_size_and_unpinned_after_the_last_view(monkeypatch):
    """torch's pinned allocator rounds up to a power of two (a 79 GB host group would take
    128 GB): tables are registered instead. Fake cudart calls record what would be pinned."""
    import gc

    from hybridrec.kernels import host_copy
    from hybridrec.sparse.host import memory

    calls = []
    monkeypatch.setattr(host_copy, "_cuda_register", lambda p, n: calls.append(("reg", p, n)) or 0)
    monkeypatch.setattr(host_copy, "_cuda_unregister", lambda p: calls.append(("unreg", p)))
    t = memory._empty_host((1000, 24), torch.float32, pin=True, what="tables t0", exact=True)
    assert t.shape == (1000, 24) and t.dtype == torch.float32 and t.is_contiguous()
    assert calls == [("reg", t.data_ptr(), 1000 * 24 * 4)]  # exact size, no rounding
    assert t.data_ptr() % 4096 == 0
    view = t[10:20]
    t.fill_(1.5)
    del t
    gc.collect()
    assert len(calls) == 1  # a view still uses the memory: still pinned
    assert float(view.sum()) == 1.5 * 10 * 24
    ptr = calls[0][1]
    del view
    gc.collect()
    assert calls[1:] == [("unreg", ptr)]  # unregistered once, before numpy frees it


def test_a_refused_pin_is_a_host_memory_error_naming_size_and_tables(monkeypatch):
    from hybridrec.kernels import host_copy
    from hybridrec.sparse.host import memory

    monkeypatch.setattr(host_copy, "_cuda_register", lambda p, n: 2)  # cudaErrorMemoryAllocation
    with pytest.raises(HostMemoryError, match=r"0\.01 GiB of pinned host memory for tables t0.*"):
        memory._empty_host((2 << 20, 1), torch.float32, pin=True, what="tables t0", exact=True)
