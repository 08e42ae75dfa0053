"""DevicePrefetcher: on CPU a pass-through that keeps order and ends cleanly; on CUDA
(tests/gpu) the batches arrive on the device, equal to the host ones."""

from __future__ import annotations

import torch

from hybridrec.data.device import DevicePrefetcher
from hybridrec.types import Batch


def _batches(n):
    return [
        Batch(torch.full((2, 3), float(i)), torch.full((2, 1), i), torch.zeros(2)) for i in range(n)
    ]


def test_cpu_pass_through_keeps_order_and_stops():
    src = _batches(3)
    got = list(DevicePrefetcher(iter(src), torch.device("cpu")))
    assert [int(b.ids[0, 0]) for b in got] == [0, 1, 2]
    assert all(g is s for g, s in zip(got, src))
