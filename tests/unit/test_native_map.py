"""The dynamic maps' C path (hybridrec/kernels/native_map.py, native/dynamic_map.c) makes the
torch path's decisions bit for bit: on drifting Zipf streams with repeats, under every eviction
and admission policy, with and without an unknown row, a shard of some buckets or all, the
two maps hold the same ids in the same slots with the same scores, last uses, totals, free
lists and candidates after every step, return the same slots and new ids, and look up the same.
Switching paths mid-run (a map checkpointed on one and resumed on the other) changes nothing."""

from __future__ import annotations

import pytest
import torch

from hybridrec import Dynamic
from hybridrec.kernels import native, native_map
from hybridrec.sparse.dynamic.idmap import DynamicMap
from hybridrec.types import ShardSpec, TableConfig

pytestmark = pytest.mark.skipif(native.lib() is None, reason="no C compiler: no native path")

POLICIES = {
    "lfu": {"evict": "lfu", "halflife": 3},
    "lru": {"evict": "lru"},
    "ttl": {"evict": "ttl", "ttl_steps": 2},
    "count": {"evict": "lfu", "admit": "count", "min_count": 2},
    "probability": {"evict": "lru", "admit": "probability", "probability": 0.6},
    "unknown_row": {"evict": "lru", "unknown": "row"},
}


def make(policy: dict, rows: int, buckets: int, shard: tuple[int, int]) -> DynamicMap:
    table = TableConfig("t", rows, 4, dynamic=Dynamic(buckets=buckets, **policy))
    return DynamicMap(table, 3, ShardSpec("t", 0, *shard, 0, 4), seed=7)


def stream(steps: int, n: int, universe: int, seed: int) -> list[torch.Tensor]:
    """Zipf-popular 40-bit ids whose popularity drifts (a new ranking every few steps)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 1 << 40, (universe,), generator=g)
    p = 1.0 / torch.arange(1, universe + 1, dtype=torch.float64) ** 1.1
    out = []
    for s in range(steps):
        if s % 4 == 0:
            raw = raw[torch.randperm(universe, generator=g)]
        out.append(raw[torch.multinomial(p, n, replacement=True, generator=g)])
    return out


def state(m: DynamicMap) -> dict[str, torch.Tensor]:
    free = [m.free[b, :n] for b, n in enumerate(m.n_free.tolist())]
    return {
        **{k: v.clone() for k, v in m.views().items()},
        "free": torch.cat(free) if free else torch.zeros(0),
        "n_free": m.n_free.clone(),
        "clock": torch.tensor(m.clock),
    }


def same(a: dict, b: dict, where: str) -> None:
    for k in a:
        assert torch.equal(a[k], b[k]), f"{where}: {k} differs"


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("shape", ["one_bucket", "buckets", "shard"])
def test_native_map_steps_as_the_torch_path(name, shape):
    rows, buckets, shard = {
        "one_bucket": (64, 1, (0, 64)),
        "buckets": (256, 8, (0, 256)),
        "shard": (256, 8, (64, 160)),
    }[shape]
    c_map, t_map = (
        make(POLICIES[name], rows, buckets, shard),
        make(POLICIES[name], rows, buckets, shard),
    )
    ids = stream(14, 300, 900, seed=len(name) + rows)
    if shape == "shard":  # the ids this shard's buckets own, as the input dist routes them
        ids = [x[(c_map.bucket_local(x) >= 0) & (c_map.bucket_local(x) < c_map.nb)] for x in ids]
    probe = torch.cat(ids[-3:] + [torch.randint(0, 1 << 40, (50,))])
    admitted = 0
    for s, x in enumerate(ids):
        c = c_map.step(x)
        with native.disabled():
            t = t_map.step(x)
        assert torch.equal(c.slots, t.slots), f"step {s}: slots differ"
        assert torch.equal(c.new_slots, t.new_slots) and torch.equal(c.new_ids, t.new_ids)
        same(state(c_map), state(t_map), f"step {s}")
        assert c_map.take_counters() == t_map.take_counters()
        admitted += c.new_slots.numel()
        assert torch.equal(c_map.find(probe), t_map.find(probe))
    assert admitted > c_map.slot_id.numel()  # the run did evict: slots were reused
    with native.disabled():
        assert torch.equal(c_map.find(probe), t_map.find(probe))  # the sorted index, rebuilt


def test_switching_paths_mid_run_changes_nothing():
    """A map that steps in C, then in torch, then in C again equals one that stays in C: each
    path's index is rebuilt from the slots when the other changed them."""
    ids = stream(12, 200, 700, seed=3)
    mixed, native_only = (
        make(POLICIES["lru"], 128, 4, (0, 128)),
        make(POLICIES["lru"], 128, 4, (0, 128)),
    )
    for s, x in enumerate(ids):
        native_only.step(x)
        if s in (4, 5, 6):
            with native.disabled():
                mixed.step(x)
        else:
            mixed.step(x)
        same(state(mixed), state(native_only), f"step {s}")


def test_native_index_holds_the_slots_through_deletions():
    """The hash index after many insertions and backward-shift deletions answers as a fresh
    build from the slots: every held id its slot, every other id -1."""
    m = make(POLICIES["lru"], 64, 1, (0, 64))
    for x in stream(30, 100, 5000, seed=11):
        m.step(x)
    held = m.slot_id[m.slot_id >= 0]
    index = m._native_index()
    assert torch.equal(index.find(held), (m.slot_id >= 0).nonzero().squeeze(1))
    fresh = native_map.NativeIndex(m.slot_id, 128)
    others = torch.randint(0, 1 << 40, (1000,))
    assert torch.equal(index.find(others), fresh.find(others))


@pytest.mark.parametrize("rows,cols", [(4096, (0, 16)), (1000, (3, 11)), (7, (0, 1))])
def test_native_fresh_rows_are_the_torch_paths(rows, cols):
    """An admitted id's initial row, computed in C, has the torch path's bits (any column
    slice, any table size), so a readmitted id starts from the same row on either path."""
    from hybridrec.kernels import hashing

    ids = torch.randint(0, 1 << 62, (3000,), generator=torch.Generator().manual_seed(rows))
    got = hashing.fresh_rows(ids, 3, 2, rows, *cols)
    with native.disabled():
        want = hashing.fresh_rows(ids, 3, 2, rows, *cols)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert got.abs().max() <= 1 / rows**0.5 and got.std() > 0.4 / rows**0.5
