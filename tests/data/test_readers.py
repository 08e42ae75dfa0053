"""Readers and batch order: block shuffling, epochs, resume, the last batch, DALI == memmap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrec.data import open_dataset
from hybridrec.data.loader import SliceLoader
from hybridrec.data.order import BatchPlan
from hybridrec.data.readers import DaliReader, MemmapReader, dali_available
from hybridrec.data.source import BinarySource

DALI_OK, DALI_WHY = dali_available()


def _rows(plan: BatchPlan, step: int) -> list[int]:
    return [r for a, b in plan.segments(step) for r in range(a, b)]


def test_plan_epochs_cover_split_once_and_reshuffle():
    plan = BatchPlan(start=5, end=105, block_rows=8, batch_size=12, shuffle=True, seed=3)
    assert plan.steps_per_epoch == 8  # 100 // 12, the partial batch dropped
    epoch0 = [r for s in range(8) for r in _rows(plan, s)]
    epoch1 = [r for s in range(8, 16) for r in _rows(plan, s)]
    assert len(set(epoch0)) == 96 and set(epoch0) <= set(range(5, 105))
    assert epoch0 != epoch1 and len(set(epoch1)) == 96
    # blocks stay whole: within a segment rows are consecutive and inside one stored block
    for a, b in plan.segments(3):
        assert (a // 8) == ((b - 1) // 8)
    same = BatchPlan(5, 105, 8, 12, True, 3)
    assert [same.segments(s) for s in range(20)] == [plan.segments(s) for s in range(20)]
    other = BatchPlan(5, 105, 8, 12, True, 4)
    assert [other.segments(s) for s in range(8)] != [plan.segments(s) for s in range(8)]


def test_plan_pad_wraps_and_no_shuffle_is_file_order():
    plan = BatchPlan(0, 20, 8, 6, shuffle=False, seed=0, last_batch="pad")
    assert plan.steps_per_epoch == 4
    assert _rows(plan, 0) == list(range(6))
    assert _rows(plan, 3) == [18, 19, 0, 1, 2, 3]  # the last batch wraps to the epoch start
    big = BatchPlan(0, 5, 8, 12, shuffle=False, seed=0, last_batch="pad")
    assert _rows(big, 0) == [0, 1, 2, 3, 4] * 2 + [0, 1]
    assert BatchPlan(0, 5, 8, 12, False, 0, "drop").steps_per_epoch == 0
    assert plan.segments(1, 2, 5) == [(8, 11)]  # a slice of a batch: samples 2..4


def test_memmap_batches_and_split_semantics(sample_dataset):
    ds = open_dataset(sample_dataset)
    src = BinarySource(ds, seed=1)
    b = src.batch(0, 32, "train")
    assert b.dense.shape == (32, 13) and b.ids.shape == (32, 26) and b.labels.shape == (32,)
    assert b.ids.dtype == torch.int64 and b.dense.dtype == torch.float32
    rows = _rows(src.plan(32, "train"), 0)
    np.testing.assert_array_equal(b.ids.numpy(), ds.categorical[rows])
    np.testing.assert_array_equal(b.labels.numpy(), ds.labels[rows].astype(np.float32))
    # eval = the val split, in order, once
    assert src.steps_per_epoch(10, "eval") == 2
    np.testing.assert_array_equal(src.batch(1, 10, "eval").dense.numpy(), ds.dense[170:180])
    with pytest.raises(IndexError, match="split 'val' has 2 batches"):
        src.batch(2, 10, "eval")
    test = BinarySource(ds, eval_split="test").batch(0, 20, "eval")
    np.testing.assert_array_equal(test.dense.numpy(), ds.dense[180:200])
    with pytest.raises(ValueError, match="split 'train' has 160 rows, fewer than one global batch"):
        src.steps_per_epoch(256, "train")


def test_loader_resume_slices_and_eval_stops(sample_dataset):
    src = BinarySource(open_dataset(sample_dataset), seed=2)
    whole = SliceLoader(src, 0, 1, 24, "train", prefetch=2)
    batches = [next(whole) for _ in range(12)]  # 160 // 24 = 6 steps per epoch: 2 epochs
    assert whole.position == 12
    whole.close()
    resumed = SliceLoader(src, 0, 1, 24, "train", start_step=7, prefetch=0)
    torch.testing.assert_close(next(resumed).ids, batches[7].ids, rtol=0, atol=0)
    for rank in range(3):
        part = SliceLoader(src, rank, 3, 24, "train", start_step=4, prefetch=1)
        b = next(part)
        torch.testing.assert_close(b.dense, batches[4].dense[rank * 8 : (rank + 1) * 8])
        part.close()
    ev = SliceLoader(src, 1, 2, 10, "eval", prefetch=2)
    assert len(list(ev)) == 2 and ev.position == 2  # 20 val rows, never wrapped


@pytest.mark.skipif(not DALI_OK, reason=f"NVIDIA DALI is not installed ({DALI_WHY})")
def test_dali_equals_memmap(tmp_path, sample_dataset):
    """Same plan, same rows: DALI's numpy-reader pipeline (CPU here) == numpy memmap, exactly."""
    ds = open_dataset(sample_dataset, verify="read")
    dali, mm = DaliReader(ds, "cpu"), MemmapReader(ds)
    for plan in (
        BatchPlan(0, 160, 8, 24, shuffle=True, seed=5),  # unaligned batches, shuffled blocks
        BatchPlan(0, 160, 8, 16, shuffle=True, seed=6, last_batch="pad"),
        BatchPlan(160, 180, 8, 12, shuffle=False, seed=0, last_batch="pad"),  # wraps
    ):
        for lo, hi in ((0, plan.batch_size), (plan.batch_size // 2, plan.batch_size)):
            for step in [0, 1, 2, 3, 9, 10, 4]:  # sequential, then a jump back (rebuild)
                a, b = dali.read(plan, step, lo, hi), mm.read(plan, step, lo, hi)
                for x, y in ((a.dense, b.dense), (a.ids, b.ids), (a.labels, b.labels)):
                    assert x.dtype == y.dtype and torch.equal(x, y), (plan.key, step, lo)
    dali.close()
    src_dali = BinarySource(ds, reader="dali", seed=7)
    src_mm = BinarySource(ds, reader="memmap", seed=7)
    for step in range(8):
        torch.testing.assert_close(
            src_dali.batch(step, 32).ids, src_mm.batch(step, 32).ids, rtol=0, atol=0
        )
    src_dali.close()


def test_dali_absent_is_a_clear_error(sample_dataset, monkeypatch):
    import hybridrec.data.readers as readers

    monkeypatch.setattr(readers, "dali_available", lambda: (False, "No module named 'nvidia'"))
    with pytest.raises(
        ImportError, match=r"data.reader=dali needs NVIDIA DALI .*hybridrec\[dali\]"
    ):
        DaliReader(open_dataset(sample_dataset))


def test_finished_loader_keeps_stopping(sample_dataset):
    src = BinarySource(open_dataset(sample_dataset))
    for prefetch in (0, 2):
        ev = SliceLoader(src, 0, 1, 20, "eval", prefetch=prefetch)
        assert len(list(ev)) == 1
        with pytest.raises(StopIteration):
            next(ev)
        ev.close()
