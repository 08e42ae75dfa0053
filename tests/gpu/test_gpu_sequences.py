"""Sequence features and next-item models on CUDA (skipped without it): a sequence collection
(a history sharing its table with a target, a host-cached table too) trained on the GPU with
the Triton kernels equal to the same steps on the CPU (rows and losses to fp32 round-off),
and SASRec's encoder (scaled_dot_product_attention's fused kernels) and HSTU's on CUDA equal
to the CPU's exact path; the step times printed (pytest -s) for the figures."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("triton")

from hybridrec.model.hstu import HSTU  # noqa: E402
from hybridrec.model.sasrec import SASRec  # noqa: E402
from hybridrec.optim import SparseAdam  # noqa: E402
from hybridrec.sparse.collection import EmbeddingCollection  # noqa: E402
from hybridrec.types import Pooling, TableConfig  # noqa: E402

L = 50


def _ids(g: torch.Generator, batch: int) -> torch.Tensor:
    items = (torch.rand(batch, L + 1, generator=g) ** 2 * 200_000).long()
    lengths = torch.randint(1, L + 1, (batch, 1), generator=g)
    history = items[:, :L].masked_fill(torch.arange(L).expand(batch, L) >= lengths, -1)
    return torch.cat([history, items[:, L:]], 1)


def _train(device: str, steps: int = 8) -> tuple[list[float], dict, float]:
    tables = [
        TableConfig("history", 200_000, 64, hotness=L, pooling=Pooling.NONE, storage="item"),
        TableConfig("target", 200_000, 64, storage="item"),
    ]
    c = EmbeddingCollection(tables, SparseAdam(0.01), seed=3, device=device)
    g = torch.Generator().manual_seed(1)
    losses, start = [], 0.0
    for s in range(steps):
        ids = _ids(g, 4096).to(device)
        if s == 2:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        out = c(ids)
        loss = (out[:, :L] * out[:, L:]).sum(-1).square().mean()
        loss.backward()
        losses.append(float(loss))
    per_step = (time.perf_counter() - start) / (steps - 2)
    rows = {spec.table: w.cpu() for spec, w, _ in c.shard_views()}
    return losses, rows, per_step


def test_a_sequence_collection_on_cuda_equals_cpu():
    gpu_losses, gpu, gpu_s = _train("cuda")
    cpu_losses, cpu, cpu_s = _train("cpu")
    print(f"sequence lookup step: cuda {gpu_s * 1e3:.2f} ms, cpu {cpu_s * 1e3:.2f} ms")
    torch.testing.assert_close(torch.tensor(gpu_losses), torch.tensor(cpu_losses))
    for k in cpu:
        torch.testing.assert_close(gpu[k], cpu[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("encoder", [SASRec, HSTU])
def test_the_encoders_on_cuda_equal_the_cpus_exact_path(encoder):
    torch.manual_seed(0)
    model = encoder(64, L, blocks=2, heads=2, dropout=0.0).eval()
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(256, L, 64, generator=g)
    mask = torch.arange(L).expand(256, L) < torch.randint(1, L + 1, (256, 1), generator=g)
    rows = rows * mask.unsqueeze(-1)
    with torch.no_grad():
        want = model(rows, mask)
        got = model.cuda()(rows.cuda(), mask.cuda()).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
