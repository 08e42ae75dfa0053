"""The dynamic tables' probe kernel (hybridrec.kernels.probe) against its torch path, on the
CPU through Triton's interpreter (TRITON_INTERPRET=1): integer results, so exactly equal.
Keys of several size classes (the kernel's halvings are a compile-time constant per class),
ids hitting and missing, below, between and above the keys, negative and beyond 2**62."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hybridrec.kernels import probe  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.delenv("HYBRIDREC_KERNELS", raising=False)
        yield


@pytest.mark.parametrize("k", [1, 2, 3, 7, 64, 300])
def test_probe_kernel_equals_searchsorted(k):
    g = torch.Generator().manual_seed(k)
    keys = torch.unique(torch.randint(-(1 << 62), 1 << 62, (k,), generator=g))
    slots = torch.randperm(keys.numel(), generator=g) * 3
    hits = keys[torch.randint(0, keys.numel(), (200,), generator=g)]
    misses = torch.randint(-(1 << 62), 1 << 62, (300,), generator=g)
    edges = torch.tensor([keys[0] - 1, keys[-1] + 1, keys[0], keys[-1], (1 << 63) - 1])
    ids = torch.cat([hits, misses, edges])[torch.randperm(505, generator=g)]
    got = probe.probe_kernel(keys, slots, ids)
    want = probe.probe_torch(keys, slots, ids)
    assert torch.equal(got, want)
    assert (got[torch.isin(ids, keys)] >= 0).all() and (got[~torch.isin(ids, keys)] == -1).all()
    assert torch.equal(probe.probe(keys, slots, ids), want)  # the dispatcher takes the kernel


def test_probe_of_nothing():
    empty = torch.zeros(0, dtype=torch.int64)
    ids = torch.tensor([1, 2, 3])
    assert torch.equal(probe.probe(empty, empty, ids), torch.full((3,), -1))
    assert probe.probe(torch.tensor([5]), torch.tensor([0]), empty).numel() == 0
