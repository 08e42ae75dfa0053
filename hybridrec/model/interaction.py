"""Feature interactions: DLRM's pairwise dot products and DCNv2's low-rank cross network.

Legend: B = batch, F = number of interacting vectors (T tables + the bottom MLP output),
D = embedding width.
"""

from __future__ import annotations

import torch
from torch import nn


class _PairwiseDots(torch.autograd.Function):
    """x [B, F, F_D] -> the strictly-lower-triangle dot products [B, P], P = F(F-1)/2.

    Autograd through `bmm(x, x^T)[:, rows, cols]` costs two bmms, a full-size add and an
    accumulating index_put (sort-based on CUDA). The Gram matrix is symmetric, so here the
    backward puts each pair's gradient in both triangles (one gather from the pair gradients
    and a zero column: `spread` [F*F] names the pair of every (i, j), P for the diagonal) and
    does one bmm: grad_x = (G + G^T) x. Mathematically equal; floating-point sums may round
    apart.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, flat: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
        b, f, _ = x.shape
        ctx.save_for_backward(x, spread)
        return torch.bmm(x, x.transpose(1, 2)).view(b, f * f).index_select(1, flat)

    @staticmethod
    def backward(ctx, grad_BP: torch.Tensor):  # noqa: ANN205
        x, spread = ctx.saved_tensors
        b, f, _ = x.shape
        g = torch.nn.functional.pad(grad_BP, (0, 1)).index_select(1, spread)
        return torch.bmm(g.view(b, f, f), x), None, None


class DotInteraction(nn.Module):
    """Pairwise dot products of F vectors, strictly lower triangle, after the dense vector.

    bottom [B, D], pooled [B, T, D] -> [B, D + F(F-1)/2] with F = T + 1. The vectors are
    ordered [bottom, table 0, ..., table T-1]; pair (i, j), i > j, appears in row-major order
    of the lower triangle. Under autocast the vectors are cast once, before the Gram matrix
    (as autocast's bmm would), and the backward hands the pooled gradient back in fp32.
    """

    def __init__(self, num_tables: int) -> None:
        super().__init__()
        f = num_tables + 1
        rows, cols = torch.tril_indices(f, f, offset=-1)
        self.num_pairs = rows.numel()
        spread = torch.full((f * f,), self.num_pairs)  # the zero column: the diagonal
        spread[rows * f + cols] = torch.arange(self.num_pairs)
        spread[cols * f + rows] = torch.arange(self.num_pairs)
        self.register_buffer("flat", rows * f + cols, persistent=False)
        self.register_buffer("spread", spread, persistent=False)

    def output_dim(self, dim: int) -> int:
        return dim + self.num_pairs

    def forward(self, bottom: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        device = pooled.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        else:
            dtype = torch.promote_types(bottom.dtype, pooled.dtype)
        x_BFD = torch.cat([bottom.unsqueeze(1).to(dtype), pooled.to(dtype)], dim=1)
        dots_BP = _PairwiseDots.apply(x_BFD, self.flat, self.spread)
        return torch.cat([bottom.to(dtype), dots_BP], dim=1)


class LowRankCrossNet(nn.Module):
    """DCNv2 cross layers with low-rank weights: x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l.

    x0 [B, N] -> [B, N]; V_l: N -> rank, U_l: rank -> N (MLPerf DLRM-DCNv2: 3 layers, rank 512).
    `xavier`: initialised as the MLPerf DCNv2 reference (torchrec's LowRankCrossNet, which its
    DLRM_DCN uses): every U_l [N, rank] and V_l [rank, N] xavier_normal_ (std sqrt(2 / (N +
    rank))); else nn.Linear's default. Every b_l zero.
    """

    def __init__(self, in_features: int, num_layers: int, rank: int, xavier: bool = True) -> None:
        super().__init__()
        self.V = nn.ModuleList(nn.Linear(in_features, rank, bias=False) for _ in range(num_layers))
        self.U = nn.ModuleList(nn.Linear(rank, in_features, bias=True) for _ in range(num_layers))
        for v, u in zip(self.V, self.U, strict=True):
            if xavier:
                nn.init.xavier_normal_(v.weight)
                nn.init.xavier_normal_(u.weight)
            nn.init.zeros_(u.bias)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for v, u in zip(self.V, self.U, strict=True):
            x = x0 * u(v(x)) + x
        return x
