"""Dynamic tables on CUDA (skipped without it): the Triton probe compiled against
searchsorted at a realistic size, and a dynamic collection trained on the GPU equal to the
same steps on the CPU (maps exactly, rows and losses to fp32 round-off), with the step time
of both printed (pytest -s) for the figures."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("triton")

from hybridrec import Dynamic  # noqa: E402
from hybridrec.kernels import probe  # noqa: E402
from hybridrec.optim import SparseAdagrad  # noqa: E402
from hybridrec.sparse.collection import EmbeddingCollection  # noqa: E402
from hybridrec.types import TableConfig  # noqa: E402


def test_probe_kernel_compiled_equals_searchsorted():
    g = torch.Generator().manual_seed(0)
    keys = torch.unique(torch.randint(0, 1 << 62, (1 << 20,), generator=g)).cuda()
    slots = torch.randperm(keys.numel(), device="cuda")
    ids = torch.cat([keys[::3], torch.randint(0, 1 << 62, (1 << 20,), device="cuda")])
    assert torch.equal(probe.probe_kernel(keys, slots, ids), probe.probe_torch(keys, slots, ids))


def _train(device: str, steps: int = 8) -> tuple[list[float], dict, float]:
    d = Dynamic(admit="count", min_count=2, evict="lfu", halflife=4, buckets=64, unknown="row")
    tables = [TableConfig(f"t{i}", 64 * 512, 32, hotness=2, dynamic=d) for i in range(4)]
    c = EmbeddingCollection(tables, SparseAdagrad(0.05), seed=3, device=device)
    g = torch.Generator().manual_seed(1)
    losses, start = [], 0.0
    for s in range(steps):
        ids = (torch.rand(16384, 8, generator=g) ** 3 * 200_000).long() + 1000 * s
        if s == 2:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        loss = c(ids.to(device)).square().mean()
        loss.backward()
        losses.append(float(loss))
    per_step = (time.perf_counter() - start) / (steps - 2)
    maps = {(k, p): m.slot_id.cpu() for k, g in c.groups.items() for p, m in g.dynamic()}
    rows = {spec.table: w.cpu() for spec, w, _ in c.shard_views()}
    return losses, {"maps": maps, "rows": rows}, per_step


def test_dynamic_collection_on_cuda_equals_cpu():
    gpu_losses, gpu, gpu_s = _train("cuda")
    cpu_losses, cpu, cpu_s = _train("cpu")
    print(f"dynamic step: cuda {gpu_s * 1e3:.2f} ms, cpu {cpu_s * 1e3:.2f} ms")
    torch.testing.assert_close(torch.tensor(gpu_losses), torch.tensor(cpu_losses))
    for k in cpu["maps"]:
        assert torch.equal(gpu["maps"][k], cpu["maps"][k]), k
    for k in cpu["rows"]:
        torch.testing.assert_close(gpu["rows"][k], cpu["rows"][k], rtol=1e-4, atol=1e-5)
