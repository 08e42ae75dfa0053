"""The plain-PyTorch DLRM every benchmark compares against, in the same process.

What a PyTorch user writes first: one `nn.EmbeddingBag(sparse=True)` per table, torch.optim's
sparse optimizers (SGD, SparseAdam, or element-wise Adagrad: torch has no row-wise one), and
the DLRM reference's dot interaction, autograd through `bmm(x, x^T)[:, rows, cols]`. The
MLPs are hybridrec's own (same layers, initialisation and parameters), so the two models are
the same function with the same weights; hybridrec's interaction computes the same forward
bits with a cheaper backward (hybridrec.model.interaction), which counts as hybridrec's.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridrec.config import Config
from hybridrec.model import DenseArch
from hybridrec.types import hot_offsets


class TextbookDotInteraction(nn.Module):
    """The DLRM reference's dot interaction (as in facebookresearch/dlrm and TorchRec):
    bottom [B, D], pooled [B, T, D] -> [B, D + F(F-1)/2], autograd for the backward."""

    def __init__(self, num_tables: int) -> None:
        super().__init__()
        rows, cols = torch.tril_indices(num_tables + 1, num_tables + 1, offset=-1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, bottom: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        x = torch.cat([bottom.unsqueeze(1), pooled], dim=1)
        z = torch.bmm(x, x.transpose(1, 2))
        return torch.cat([bottom, z[:, self.rows, self.cols]], dim=1)


class PlainDLRM(nn.Module):
    """One nn.EmbeddingBag(sparse=True) per table + hybridrec's MLPs, with the reference's
    dot interaction (DCNv2 models keep hybridrec's cross network)."""

    def __init__(self, cfg: Config, device: torch.device | str | None = None) -> None:
        """Tables are created (and randomly initialised) on `device` (default CPU)."""
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.dense = DenseArch(cfg.model)
        if cfg.model.arch == "dlrm":
            num_tables = len(cfg.model.num_embeddings_per_feature)
            self.dense.interaction = TextbookDotInteraction(num_tables)
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
