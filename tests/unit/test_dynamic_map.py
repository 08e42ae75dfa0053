"""DynamicMap and its policy (hybridrec.sparse.dynamic) on hand-made steps: what each policy
admits and evicts, that decisions depend on each bucket's ids alone and not on their order,
that an id's fresh row is one function of (seed, table, id, column), and the one-line errors."""

from __future__ import annotations

import pytest
import torch

from hybridrec import Dynamic
from hybridrec.kernels import hashing
from hybridrec.sparse.dynamic.idmap import DynamicMap
from hybridrec.sparse.dynamic.policy import bound_candidates
from hybridrec.types import ShardSpec, TableConfig


def make_map(rows: int = 8, buckets: int = 1, shard: tuple[int, int] | None = None, **policy):
    table = TableConfig("t", rows, 4, dynamic=Dynamic(buckets=buckets, **policy))
    a, b = shard or (0, rows)
    return DynamicMap(table, 0, ShardSpec("t", 0, a, b, 0, 4), seed=5)


def ids_of(dmap: DynamicMap) -> set[int]:
    return {i for i in dmap.slot_id.tolist() if i >= 0}


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_mix64_matches_its_integer_form_and_buckets_are_in_range():
    x = torch.tensor([0, 1, -1, (1 << 63) - 1, -(1 << 63), 1234567890123])
    assert hashing.mix64(x).tolist() == [hashing.mix64_int(int(v)) for v in x]
    b = hashing.bucket_of(torch.arange(10_000), 7)
    assert b.min() == 0 and b.max() == 6
    assert (torch.bincount(b) > 1300).all()  # spread over the buckets


def test_fresh_rows_depend_on_the_id_and_column_only():
    ids = t(3, 1 << 40, 7)
    whole = hashing.fresh_rows(ids, 1, 2, 100, 0, 8)
    assert whole.shape == (3, 8) and whole.abs().max() <= 0.1
    assert torch.equal(hashing.fresh_rows(ids[1:], 1, 2, 100, 3, 6), whole[1:, 3:6])
    assert not torch.equal(hashing.fresh_rows(ids, 1, 3, 100, 0, 8), whole)  # another table
    assert not torch.equal(hashing.fresh_rows(ids, 2, 2, 100, 0, 8), whole)  # another seed


def test_always_lru_evicts_the_least_recently_used_never_this_steps():
    m = make_map(rows=4, evict="lru")
    m.step(t(10, 11, 12, 13))
    m.step(t(10, 11))  # 12 and 13 now the oldest
    out = m.step(t(10, 20, 21))
    assert ids_of(m) == {10, 11, 20, 21}
    assert (out.slots >= 0).all() and sorted(out.new_ids.tolist()) == [20, 21]
    out = m.step(t(30, 31, 32, 33, 34))  # 5 new ids, 4 slots: the smallest 4 ids get them
    assert ids_of(m) == {30, 31, 32, 33} and out.slots.tolist()[-1] == -1


def test_lfu_keeps_the_frequent_and_ages_counts():
    m = make_map(rows=3, evict="lfu", halflife=100)
    m.step(t(1, 1, 1, 2, 3, 3))
    m.step(t(1, 4))  # evicts 2 (count 1; 3 has 2)
    assert ids_of(m) == {1, 3, 4}
    score = dict(zip(m.slot_id.tolist(), m.score.tolist(), strict=True))
    assert score == {1: 4.0, 3: 2.0, 4: 1.0}  # a new id starts from its step's count
    aged = make_map(rows=3, evict="lfu", halflife=1)
    aged.step(t(1, 1))
    assert aged.score.max().item() == 1.0  # halved after the step


def test_ttl_frees_expired_slots_and_refuses_when_none_expired():
    m = make_map(rows=2, evict="ttl", ttl_steps=2)
    m.step(t(1, 2))
    out = m.step(t(3))  # full, nothing expired: 3 gets no slot
    assert out.slots.tolist() == [-1] and ids_of(m) == {1, 2}
    m.step(t(1))
    out = m.step(t(3))  # 2 unused for 2 steps (steps 2 and 3): expired at step 4
    assert out.slots.tolist() != [-1] and ids_of(m) == {1, 3}


def test_count_admission_counts_across_steps_in_bounded_memory():
    m = make_map(rows=4, admit="count", min_count=3)
    m.step(t(7, 7, 8))
    assert ids_of(m) == set() and dict(zip(m.cand_ids.tolist(), m.cand_counts.tolist())) == {
        7: 2,
        8: 1,
    }
    m.step(t(7, 8))
    assert ids_of(m) == {7}  # 7 reached 3; 8 is at 2
    m.step(t(*range(100, 110)))  # 10 new candidates in a bucket of 4 rows: 4 kept
    assert m.cand_ids.numel() == 4 and 8 in m.cand_ids.tolist()  # the highest counts stay
    ids, counts = bound_candidates(t(1, 2, 3, 4), t(1, 5, 5, 2), t(0, 0, 0, 1), 1)
    assert ids.tolist() == [2, 4] and counts.tolist() == [5, 2]  # ties to the smaller id


def test_probability_admission_is_a_fixed_draw_per_id():
    a, b = make_map(rows=4096, admit="probability", probability=0.3), None
    a.step(torch.arange(1000))
    b = make_map(rows=4096, admit="probability", probability=0.3)
    b.step(torch.arange(999, -1, -1))
    assert ids_of(a) == ids_of(b) and 230 < len(ids_of(a)) < 370


def test_decisions_ignore_order_and_other_buckets():
    ids = torch.randint(0, 1 << 40, (300,), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([ids, ids[:100]])
    whole = make_map(rows=64, buckets=8, evict="lru")
    low, high = (
        make_map(rows=64, buckets=8, evict="lru", shard=(0, 24)),
        make_map(rows=64, buckets=8, evict="lru", shard=(24, 64)),
    )
    for step in range(3):
        part = ids[step * 100 : step * 100 + 150]
        whole.step(part)
        shuffled = part[torch.randperm(part.numel())]
        owner = hashing.bucket_of(shuffled, 8) * 8 < 24
        low.step(shuffled[owner])
        high.step(shuffled[~owner])
    assert torch.equal(torch.cat([low.slot_id, high.slot_id]), whole.slot_id)
    assert torch.equal(torch.cat([low.last, high.last]), whole.last)
    kept = whole.find(ids), whole.free.clone(), whole.n_free.clone()  # updated step by step
    whole._rebuild()  # ... equal to the index and free lists made anew from the slots
    assert torch.equal(kept[0], whole.find(ids)) and torch.equal(kept[2], whole.n_free)
    for b, n in enumerate(kept[2].tolist()):
        assert torch.equal(kept[1][b, :n], whole.free[b, :n])


def test_unknown_ids_go_to_their_buckets_row_or_leave_their_bag():
    m = make_map(rows=8, buckets=2, unknown="row")
    m.step(t(1, 2))
    ids = t(1, 99, 100)
    slots = m.find(ids)
    rows, kept = m.resolve(ids, slots)
    assert kept is None and rows[0] == slots[0]
    unknown = (hashing.bucket_of(ids[1:], 2) * 4 + 3).tolist()
    assert rows[1:].tolist() == unknown  # the last row of each bucket
    z = make_map(rows=8, buckets=2)
    z.step(t(1, 2))
    rows, kept = z.resolve(ids, z.find(ids))
    assert kept.tolist() == [0] and rows.numel() == 1
    assert m.occupancy() == (2, 6) and z.occupancy() == (2, 8)


def test_bad_declarations_fail_in_one_line():
    with pytest.raises(ValueError, match="multiple of buckets=3"):
        TableConfig("u", 10, 4, dynamic=Dynamic(buckets=3))
    with pytest.raises(ValueError, match="one is its unknown row"):
        TableConfig("u", 4, 4, dynamic=Dynamic(buckets=4, unknown="row"))
    with pytest.raises(ValueError, match="own whole buckets"):
        make_map(rows=8, buckets=2, shard=(0, 3))


def test_a_full_bucket_evicts_a_share_at_once_and_then_takes_free_slots():
    m = make_map(rows=64, evict="lru")  # one bucket of 64: an eviction frees 64 / 16 = 4
    m.step(torch.arange(64))  # full
    m.step(torch.arange(10, 64))  # 0..9 are now the least recently used
    out = m.step(t(100))
    assert ids_of(m) == set(range(4, 64)) | {100}  # 0..3 went, 100 took the first freed
    assert out.slots.tolist() == [0] and m.n_free.tolist() == [3]
    assert m.counters.evicted == 4 and m.evicts.sum() == 4
    out = m.step(t(101, 102, 103, 104))  # 3 free slots, then 4..7's eviction
    assert sorted(out.slots.tolist()) == [1, 2, 3, 4] and m.n_free.tolist() == [3]
    assert ids_of(m) == set(range(8, 64)) | {100, 101, 102, 103, 104}
    kept = m.free.clone(), m.n_free.clone(), m.find(torch.arange(200))
    m._rebuild()  # the free list and the index are functions of the slots
    assert torch.equal(kept[1], m.n_free) and torch.equal(kept[0][0, :3], m.free[0, :3])
    assert torch.equal(kept[2], m.find(torch.arange(200)))


def test_a_state_dict_whose_slot_ids_break_the_map_is_refused_naming_the_table():
    m = make_map(rows=16, buckets=4, evict="lru")
    m.step(torch.arange(100, 140))
    state = m.state_dict()
    again = make_map(rows=16, buckets=4, evict="lru")
    again.load_state_dict(state)  # its own state loads
    assert torch.equal(again.find(torch.arange(100, 140)), m.find(torch.arange(100, 140)))
    moved = {**state, "slot_id": torch.roll(state["slot_id"], 4)}  # each id a bucket on
    with pytest.raises(
        ValueError,
        match=r"^dynamic table 't': the state dict loaded into its map"
        r" \(rows 0:16\) does not fit its policy: row 0 \(dyn_slot_id\) holds id",
    ):
        make_map(rows=16, buckets=4, evict="lru").load_state_dict(moved)
