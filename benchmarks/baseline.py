"""The plain-PyTorch DLRM every benchmark compares against, in the same process.

One `nn.EmbeddingBag(sparse=True)` per table (what a PyTorch user writes first), hybridrec's
own dense part (so only the embedding side differs), and torch.optim's sparse optimizers:
SGD, SparseAdam, or element-wise Adagrad (torch has no row-wise one).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridrec.config import Config
from hybridrec.model import DenseArch
from hybridrec.types import hot_offsets


class PlainDLRM(nn.Module):
    """One nn.EmbeddingBag(sparse=True) per table + hybridrec's dense part (same MLPs)."""

    def __init__(self, cfg: Config, device: torch.device | str | None = None) -> None:
        """Tables are created (and randomly initialised) on `device` (default CPU)."""
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.dense = DenseArch(cfg.model)
        tables = cfg.model.tables()
        self.offsets = hot_offsets(tables)
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(t.num_rows, t.dim, mode=t.pooling.value, sparse=True, device=device)
            for t in tables
        )

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pooled = torch.stack(
            [bag(ids[:, self.offsets[i] : self.offsets[i + 1]]) for i, bag in enumerate(self.bags)],
            dim=1,
        )
        return self.dense(dense, pooled)


def plain_sparse_optimizer(params: list[nn.Parameter], cfg: Config) -> torch.optim.Optimizer:
    s = cfg.optim.sparse
    if s.name == "sgd":
        return torch.optim.SGD(params, lr=s.lr)
    if s.name == "adam":
        return torch.optim.SparseAdam(params, lr=s.lr, betas=(s.beta1, s.beta2), eps=s.eps)
    return torch.optim.Adagrad(params, lr=s.lr, eps=s.eps)  # element-wise: no row-wise one
