"""DLRM and DLRM-DCNv2: a dense part (MLPs + interaction) over an embedding collection.

    dense [B, F_dense] --bottom MLP--> [B, D] --+
                                                +--interaction--> top MLP --> logit [B]
    ids [B, H] --embedding collection--> [B, T, D]

The model holds two children: `embeddings` (any module with forward(ids [B, H]) -> [B, T, D],
or [B, sum_t D_t] for tables of different widths (dcnv2 only),
that updates its rows in the backward: the local EmbeddingCollection or a sharded one) and
`dense` (DenseArch, everything else; the only part data-parallel training wraps in DDP).
This module never imports torch.distributed.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridrec.config import ModelConfig
from hybridrec.model.interaction import DotInteraction, LowRankCrossNet
from hybridrec.model.mlp import MLP


class DenseArch(nn.Module):
    """Bottom MLP, interaction, top MLP: (dense [B, F], pooled [B, T, D]) -> logits [B].

    dcnv2 takes tables of different widths: pooled is then [B, sum_t D_t] (tables in order)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        num_tables = len(cfg.num_embeddings_per_feature)
        init = cfg.init
        if init == "reference":  # each arch's reference (hybridrec.model.mlp)
            init = "dlrm" if cfg.arch == "dlrm" else "torch"
        self.bottom = MLP(cfg.num_dense_features, cfg.bottom_mlp, final_relu=True, init=init)
        self.arch = cfg.arch
        if cfg.arch == "dlrm":
            self.interaction: nn.Module = DotInteraction(num_tables)
            top_in = self.interaction.output_dim(cfg.bottom_mlp[-1])
        else:  # bottom output and every table's pooled vector, concatenated
            top_in = cfg.bottom_mlp[-1] + sum(cfg.dims())
            xavier = cfg.init == "reference"
            self.interaction = LowRankCrossNet(top_in, cfg.dcn_layers, cfg.dcn_rank, xavier)
        self.top = MLP(top_in, cfg.top_mlp, final_relu=False, init=init)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        bottom = self.bottom(dense)
        if self.arch == "dlrm":
            x = self.interaction(bottom, pooled)
        else:
            x = self.interaction(torch.cat([bottom, pooled.flatten(1)], dim=1))
        return self.top(x).squeeze(1)


class DLRM(nn.Module):
    """The full model; `embeddings` is injected so sharded/host versions can replace it."""

    def __init__(self, dense: DenseArch, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.dense = dense

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """dense [B, F] float, ids [B, H] int64 -> raw outputs [B] fp32 (logits when binary)."""
        pooled = self.embeddings(ids)
        return self.dense(dense, pooled).float()
