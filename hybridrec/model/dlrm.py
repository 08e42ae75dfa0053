"""DLRM and DLRM-DCNv2: a dense part (MLPs + interaction) over the model's embedding tables.

    dense [B, F_dense] --bottom MLP--> [B, D] --+
                                                +--interaction--> top MLP --> logit [B]
    ids (KeyedIds) --embeddings--> [B, T, D]

`DLRM` is the dense part (`DenseArch`: bottom MLP, interaction, top MLP) plus the tables it
declares (`embeddings`, an EmbeddingTables over the model config's features), built and
sharded like any model: hybridrec.parallelize gives the tables their rows. The tables keep
their plain names (cat_0, ...; namespace "") and the dense part its keys (bottom.0.weight,
...), as checkpoints and exports have always named them. dlrm declares `autocast_output`:
its dot interaction casts the pooled vectors to the autocast dtype before any other use.
This module never imports torch.distributed.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridrec.config import ModelConfig
from hybridrec.model.interaction import DotInteraction, LowRankCrossNet
from hybridrec.model.mlp import MLP
from hybridrec.model.tables import EmbeddingTables
from hybridrec.types import KeyedIds


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


class DLRM(DenseArch):
    """The full model: DenseArch over `embeddings`, the model config's tables.

    forward(dense [B, F] float, ids: KeyedIds of the config's features) -> raw outputs [B]
    fp32 (logits when binary)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.embeddings = EmbeddingTables.of(
            config.tables(), namespace="", autocast_output=config.arch == "dlrm"
        )

    def forward(self, dense: torch.Tensor, ids: KeyedIds) -> torch.Tensor:  # type: ignore[override]
        return super().forward(dense, self.embeddings(ids).tensor).float()
