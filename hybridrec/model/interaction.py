"""Feature interactions: DLRM's pairwise dot products and DCNv2's low-rank cross network.

Legend: B = batch, F = number of interacting vectors (T tables + the bottom MLP output),
D = embedding width.
"""

from __future__ import annotations

import torch
from torch import nn


class DotInteraction(nn.Module):
    """Pairwise dot products of F vectors, strictly lower triangle, after the dense vector.

    bottom [B, D], pooled [B, T, D] -> [B, D + F(F-1)/2] with F = T + 1. The vectors are
    ordered [bottom, table 0, ..., table T-1]; pair (i, j), i > j, appears in row-major order
    of the lower triangle.
    """

    def __init__(self, num_tables: int) -> None:
        super().__init__()
        f = num_tables + 1
        rows, cols = torch.tril_indices(f, f, offset=-1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.num_pairs = rows.numel()

    def output_dim(self, dim: int) -> int:
        return dim + self.num_pairs

    def forward(self, bottom: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        x_BFD = torch.cat([bottom.unsqueeze(1), pooled], dim=1)
        z_BFF = torch.bmm(x_BFD, x_BFD.transpose(1, 2))
        return torch.cat([bottom, z_BFF[:, self.rows, self.cols]], dim=1)


class LowRankCrossNet(nn.Module):
    """DCNv2 cross layers with low-rank weights: x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l.

    x0 [B, N] -> [B, N]; V_l: N -> rank, U_l: rank -> N (MLPerf DLRM-DCNv2: 3 layers, rank 512).
    """

    def __init__(self, in_features: int, num_layers: int, rank: int) -> None:
        super().__init__()
        self.V = nn.ModuleList(nn.Linear(in_features, rank, bias=False) for _ in range(num_layers))
        self.U = nn.ModuleList(nn.Linear(rank, in_features, bias=True) for _ in range(num_layers))
        for u in self.U:
            nn.init.zeros_(u.bias)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for v, u in zip(self.V, self.U, strict=True):
            x = x0 * u(v(x)) + x
        return x
