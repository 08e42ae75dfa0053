"""Element-wise Adagrad (SparseAdagrad) on CUDA against torch.optim.Adagrad on CUDA.

As tests/unit/test_sparse.py does on the CPU: one table looked up by the fused group and by
nn.EmbeddingBag (whose dense gradient covers the whole table) on the same bags, stepped by
SparseAdagrad and by torch.optim.Adagrad (no lr decay, accumulators from 0) for several
steps whose bags repeat rows. Rows a batch does not touch get g = 0, which leaves their sum
and weight unchanged, so every row and accumulator must agree, and untouched rows must keep
their bits. Through the compiled Triton kernels and through the torch ops on the GPU.

Tolerance: fp32 round-off (CUDA's embedding_bag backward adds a row's terms in another order
than the kernels). Every term of an element's gradient has that column's sign, so no
gradient cancels to near zero: there g / (sqrt(g^2) + eps) is sign(g) x lr, a sign that
round-off may decide (docs/sharding.md), which is the model's property, not the kernels'.
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.kernels import dispatch
from hybridrec.optim import SparseAdagrad
from hybridrec.sparse.fused import FusedEmbedding, LookupInput
from hybridrec.sparse.layout import full_shard
from hybridrec.types import Pooling, TableConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("HYBRIDREC_KERNELS", raising=False)


def _ids(gen: torch.Generator, bags: int, hotness: int, touched: int, hot: bool) -> torch.Tensor:
    """[bags, hotness] ids below `touched`: uniform, or (hot) skewed so that a few rows
    collect thousands of ids."""
    u = torch.rand(bags, hotness, generator=gen, device="cuda")
    return ((u**4 if hot else u) * touched).long()


@pytest.mark.parametrize("kernels", ["triton", "torch"])
@pytest.mark.parametrize("eps", [1e-10, 1e-3])  # torch.optim.Adagrad's default, and larger
@pytest.mark.parametrize("case", ["few", "hot"])
@pytest.mark.parametrize("pooling", [Pooling.SUM, Pooling.MEAN])
def test_adagrad_matches_torch_adagrad_on_cuda(pooling, case, eps, kernels):
    if kernels == "triton":
        pytest.importorskip("triton")
    rows, dim, steps = (50, 8, 5) if case == "few" else (20_000, 64, 4)
    bags, hotness = (6, 3) if case == "few" else (4096, 4)
    touched = 20 if case == "few" else 10_000  # rows touched..rows never are
    table = TableConfig("t", rows, dim, hotness, pooling)
    fused = FusedEmbedding([(table, 0, full_shard(table))], SparseAdagrad(0.1, eps), 1, "cuda")
    ref = torch.nn.EmbeddingBag(rows, dim, mode=pooling.value, device="cuda")
    with torch.no_grad():
        ref.weight.copy_(fused.weight)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1, eps=eps)
    start = fused.weight.clone()
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = 1 / hotness if pooling == Pooling.MEAN else 1.0
    sign = torch.where(torch.arange(dim, device="cuda") % 2 == 0, 1.0, -1.0)
    with dispatch.use_kernels(kernels):
        assert dispatch.available(fused.weight) == (kernels == "triton")
        for _ in range(steps):
            ids = _ids(gen, bags, hotness, touched, case == "hot")
            # |coeff| in [0.5, 1.5), one sign per column: no element's terms cancel
            coeff = sign * (0.5 + torch.rand(bags, dim, generator=gen, device="cuda"))
            flat = torch.arange(bags, device="cuda").repeat_interleave(hotness)
            out = fused([LookupInput(ids.reshape(-1), flat, bags, scale)])[0]
            (out * coeff).sum().backward()  # updates the touched rows
            ref_out = ref(ids)
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
            ref_opt.zero_grad()
            (ref_out * coeff).sum().backward()
            ref_opt.step()
    want, want_sum = ref.weight.detach(), ref_opt.state[ref.weight]["sum"]
    torch.testing.assert_close(fused.weight, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.state()["sum"], want_sum, rtol=1e-5, atol=1e-7)
    assert torch.equal(fused.weight[touched:], start[touched:])  # never touched
    assert torch.equal(want[touched:], start[touched:])
    assert not fused.state()["sum"][touched:].any()
