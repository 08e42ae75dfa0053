"""The UVA copy kernel (in Triton's CPU interpreter here; on pinned memory on CUDA): it
copies rows and row state, and a host group moving its rows by it trains as the device group,
bit for bit; where it cannot run, asking for it is an error.
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.optim import SparseSGD
from hybridrec.sparse.fused import FusedEmbedding
from hybridrec.sparse.host import HostCachedEmbedding
from tests.hostcache import BATCH, SHARDS, group_lookup, row_optimizers, skewed_batch, train_step

# Under the interpreter both groups run the Triton kernels, and both dedupe without a host
# sync (fixed tiles of sorted ids): the same sums in the same order, bit for bit.
TRITON_TOL = {"rtol": 0, "atol": 0}


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_copy_rows_kernel_copies_rows_and_row_state(interpreter):
    from hybridrec.kernels.host_copy import copy_rows

    src = torch.randn(50, 7)
    dst = torch.zeros(9, 7)
    src_rows, dst_rows = torch.tensor([3, 49, 0, 17]), torch.tensor([8, 0, 2, 5])
    copy_rows(src, src_rows, dst, dst_rows)
    want = torch.zeros(9, 7)
    want[dst_rows] = src[src_rows]
    assert torch.equal(dst, want)
    acc, small = torch.arange(50.0), torch.zeros(9)  # a 1-D (row-wise) state
    copy_rows(acc, src_rows, small, dst_rows)
    assert small[[8, 0, 2, 5]].tolist() == [3.0, 49.0, 0.0, 17.0]
    copy_rows(src, src_rows[:0], dst, dst_rows[:0])  # nothing to copy
    before = dst.clone()
    copy_rows(src, torch.tensor([1, 2, 3]), dst, torch.tensor([-1, 4, -1]))  # -1: skipped
    want = before.clone()
    want[4] = src[2]
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="must share dtype and row shape"):
        copy_rows(src, src_rows, torch.zeros(9, 6), dst_rows)


@pytest.mark.parametrize("opt", ["rowwise_adagrad", "adam"])
def test_kernel_copies_give_the_same_training(interpreter, opt):
    make = row_optimizers()[opt]
    ref = FusedEmbedding(SHARDS, make(), seed=3)
    host = HostCachedEmbedding(SHARDS, make(), cache_rows=2 * 3 * BATCH + 5, seed=3, copy="kernel")
    assert host.use_kernel
    host._compile_copies()  # what CUDA runs at start (each state's layout): host rows untouched
    assert torch.equal(host.weight, ref.weight)
    g = torch.Generator().manual_seed(0)
    batches = [skewed_batch(g) for _ in range(8)]
    ahead = None
    for step, inputs in enumerate(batches):
        coeff = [torch.randn(BATCH, 8, generator=g) for _ in range(2)]
        out_ref = train_step(ref, inputs, coeff)
        out = group_lookup(host, host.flatten(inputs), ahead)
        if step + 1 < len(batches):
            ahead = host.prefetch(host.flatten(batches[step + 1])[0])
        sum((o * c).sum() for o, c in zip(out, coeff, strict=True)).backward()
        for a, b in zip(out, out_ref, strict=True):
            torch.testing.assert_close(a.detach(), b, **TRITON_TOL)
    assert host.take_stats().rows_written > 0
    assert host.prefetched_lookups == len(batches) - 1
    host.flush()
    torch.testing.assert_close(host.weight, ref.weight, **TRITON_TOL)
    for name, value in ref.state().items():
        torch.testing.assert_close(host.state()[name], value, **TRITON_TOL)


def test_kernel_copy_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="host_copy=kernel: a GPU kernel cannot read"):
        HostCachedEmbedding(SHARDS, SparseSGD(0.1), cache_rows=60, copy="kernel")
    with pytest.raises(ValueError, match="is not one of: auto, kernel, staged"):
        HostCachedEmbedding(SHARDS, SparseSGD(0.1), cache_rows=60, copy="uva")
