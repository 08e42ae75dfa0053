"""Why element-wise Adagrad at eps 1e-10 differs across backends by more than round-off
(docs/sharding.md), reproduced on the CPU: the library model (tests/gpu/library_model.py)
trained twice, the second time with every logit's gradient scaled by 1 + 1e-6 x noise (what
summing in another order does, a little exaggerated). An element's first step is
lr x g / (|g| + eps): about sign(g) x lr for any |g| well above eps, so where a gradient's
terms nearly cancel, to about the noise, the noise steers a step of a good part of lr at eps
1e-10. The two runs' weights end up to 2 x lr apart, and drift further as those rows feed
later gradients (after 24 steps a few hundred weights differ by over 1e-3); at eps 1e-3 such
gradients step next to nothing and the weights stay within 1e-7.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridrec
from hybridrec import KeyedIds
from tests.gpu.library_model import FEATURES, TwoTowers, _full_tables, batches, sparse_optimizer

STEPS, BATCH, LR = 24, 2048, 0.1


def _train(optimizer: str, eps: float | None, noise: float) -> dict:
    torch.manual_seed(0)
    model = hybridrec.parallelize(
        TwoTowers(),
        batch_size=BATCH,
        sparse_optimizer=sparse_optimizer(optimizer, eps),
        sharding="none",
        seed=11,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names, hotness = zip(*FEATURES, strict=True)
    g = torch.Generator().manual_seed(5)
    for dense, ids, labels in batches(STEPS, BATCH):
        out = model(dense, KeyedIds(ids, names, hotness))
        if noise:
            out.register_hook(
                lambda grad: grad * (1 + noise * torch.randn(grad.shape, generator=g))
            )
        nn.functional.binary_cross_entropy_with_logits(out, labels).backward()
        opt.step()
        opt.zero_grad()
    return {t: e["weight"] for t, e in _full_tables(model).items()}


def _largest_weight_difference(optimizer: str, eps: float | None) -> float:
    a, b = _train(optimizer, eps, 0.0), _train(optimizer, eps, 1e-6)
    return max(float((a[t] - b[t]).abs().max()) for t in a)


@pytest.mark.parametrize(
    "optimizer,eps,low,high",
    [
        ("adagrad", 1e-10, LR, 2.5 * LR),  # flipped steps: O(lr)
        ("adagrad", 1e-3, 0.0, 1e-6),  # round-off
    ],
)
def test_round_off_in_a_gradient_moves_adagrad_weights_by_lr_only_at_tiny_eps(
    optimizer, eps, low, high
):
    diff = _largest_weight_difference(optimizer, eps)
    assert low <= diff <= high, f"{optimizer} eps {eps}: weights {diff:.2e} apart"
