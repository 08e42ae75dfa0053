"""The dense (MLP) optimizer: a torch.optim optimizer over the dense parameters only.

Multi-tensor (`foreach`) implementations on every device, and the fused kernel for Adam on
CUDA: one launch per step instead of one per parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybridrec.config import DenseOptimConfig

# optim.dense.name: the torch.optim optimizers build_dense_optimizer makes
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")


def build_dense_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: DenseOptimConfig, device: torch.device
) -> torch.optim.Optimizer:
    params = list(params)
    if not params:  # an embeddings-only model (matrix factorisation): nothing dense to step;
        # torch.optim refuses no parameters, and a size-0 one makes every step a no-op
        params = [torch.nn.Parameter(torch.empty(0, device=device))]
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **fast
        )
    if cfg.name == "adagrad":
        opts = {"foreach": True} if device.type == "cuda" else fast
        return torch.optim.Adagrad(
            params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay, **opts
        )
    if cfg.name == "adam":
        return torch.optim.Adam(
            params,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            **fast,
        )
    raise ValueError(f"optim.dense.name={cfg.name!r} is not one of: {', '.join(DENSE_OPTIMIZERS)}")
