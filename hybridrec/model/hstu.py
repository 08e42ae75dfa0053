"""HSTU's encoder: hierarchical sequential transduction units (Zhai et al., "Actions Speak
Louder than Words: Trillion-Parameter Sequential Transducers for Generative
Recommendations", ICML 2024), as the paper's public code runs them on the traditional
sequential-recommendation setting, on padded dense tensors.

    encoder = HSTU(dim=64, max_len=200, blocks=2, heads=1)
    hidden = encoder(rows, mask)     # rows [B, L, D], mask [B, L] bool -> hidden [B, L, D]

Input contract as hybridrec.model.sasrec (left-aligned, PAD past each length with zero rows,
L <= max_len); hidden[b, i] reads events 0..i of row b only, and PAD positions' outputs are
zeros, never to be used.

Input: x = rows * sqrt(D) + position embedding (`positions`, as SASRec's), dropout, zeroed
at PAD. One unit, per the paper's equations (1)-(3):
    U, V, Q, K = split(SiLU(LN(x) W))                 W [D, 2 H dv + 2 H dqk], no bias
    A[i, j] = SiLU(<Q_i, K_j> + rab(i - j)) / max_len   for events j <= i, else 0
    x = x + Linear(dropout(U * LN(A V)))               (per head, heads concatenated)
    x = x * mask
LayerNorms without affine weights (eps 1e-6). The attention is pointwise: no softmax, so a
position's weights do not compete and the weights are divided by the constant max_len (not
the batch's padded length, so padding never changes a real position's output). rab is a
learned relative position bias, one scalar per distance i - j in [0, max_len) shared by the
heads (the paper's code adds a bucketed time bias when timestamps exist; the `user item`
data has none). Output (`output_norm`): "l2" normalises each hidden state (the paper's code,
for a softmax with a temperature over L2-normalised items), "none" leaves it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridrec.model.sasrec import POSITIONS, check_sequence_input, position_ids

OUTPUT_NORMS = ("l2", "none")
EPS = 1e-6


def hstu_weights(mask: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] float: 1 where query i reads key j (j <= i, key j an event), else 0."""
    length = mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    return (causal & mask[:, None, :]).unsqueeze(1).float()


class HSTUBlock(nn.Module):
    """One HSTU unit (module docstring). dqk, dv: per-head widths of Q/K and of U/V."""

    def __init__(
        self,
        dim: int,
        max_len: int,
        heads: int,
        dqk: int,
        dv: int,
        dropout: float,
        attn_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.heads, self.dqk, self.dv, self.max_len = heads, dqk, dv, max_len
        self.dropout, self.attn_dropout = dropout, attn_dropout
        width = 2 * heads * dv + 2 * heads * dqk
        self.uvqk = nn.Parameter(torch.empty(dim, width).normal_(mean=0.0, std=0.02))
        self.rab = nn.Parameter(torch.empty(max_len).normal_(mean=0.0, std=0.02))
        self.out = nn.Linear(heads * dv, dim)
        nn.init.xavier_uniform_(self.out.weight)

    def relative_bias(self, length: int, device: torch.device) -> torch.Tensor:
        """[L, L]: rab(i - j) at query i, key j (distances past the diagonal clamped: those
        pairs are masked)."""
        i = torch.arange(length, device=device)
        return self.rab[(i[:, None] - i[None, :]).clamp(min=0)]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x [B, L, D]; weights: hstu_weights' [B, 1, L, L]; keep [B, L, 1] (1 at events)."""
        b, length, dim = x.shape
        h = nn.functional.layer_norm(x, (dim,), eps=EPS)
        uvqk = nn.functional.silu(h @ self.uvqk)
        sizes = [self.heads * self.dv] * 2 + [self.heads * self.dqk] * 2
        u, v, q, k = uvqk.split(sizes, dim=-1)
        q = q.view(b, length, self.heads, self.dqk).transpose(1, 2)  # [B, H, L, dqk]
        k = k.view(b, length, self.heads, self.dqk).transpose(1, 2)
        v = v.view(b, length, self.heads, self.dv).transpose(1, 2)  # [B, H, L, dv]
        scores = q @ k.transpose(-1, -2) + self.relative_bias(length, x.device)
        attn = nn.functional.silu(scores) / self.max_len * weights
        attn = nn.functional.dropout(attn, self.attn_dropout, self.training)
        av = (attn @ v).transpose(1, 2).reshape(b, length, self.heads * self.dv)
        y = u * nn.functional.layer_norm(av, (self.heads * self.dv,), eps=EPS)
        x = x + self.out(nn.functional.dropout(y, self.dropout, self.training))
        return x * keep


class HSTU(nn.Module):
    """HSTU's unit stack (module docstring): rows [B, L, D] and mask [B, L] -> hidden
    [B, L, D]. dqk and dv default to dim / heads."""

    def __init__(
        self,
        dim: int,
        max_len: int,
        blocks: int = 2,
        heads: int = 1,
        dqk: int | None = None,
        dv: int | None = None,
        dropout: float = 0.2,
        attn_dropout: float = 0.0,
        positions: str = "from_start",
        output_norm: str = "l2",
    ) -> None:
        super().__init__()
        if positions not in POSITIONS:
            raise ValueError(f"HSTU: positions={positions!r} is not one of {POSITIONS}")
        if output_norm not in OUTPUT_NORMS:
            raise ValueError(f"HSTU: output_norm={output_norm!r} is not one of {OUTPUT_NORMS}")
        dqk = dqk or dim // heads
        dv = dv or dim // heads
        self.dim, self.max_len, self.positions = dim, max_len, positions
        self.output_norm = output_norm
        self.position = nn.Embedding(max_len, dim)
        nn.init.xavier_normal_(self.position.weight)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            HSTUBlock(dim, max_len, heads, dqk, dv, dropout, attn_dropout) for _ in range(blocks)
        )

    def forward(self, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        check_sequence_input(rows, mask, self.max_len, "HSTU")
        keep = mask.unsqueeze(-1).to(rows.dtype)
        x = rows * math.sqrt(self.dim)
        x = x + self.position(position_ids(mask, self.max_len, self.positions))
        x = self.drop(x) * keep
        weights = hstu_weights(mask)
        for block in self.blocks:
            x = block(x, weights, keep)
        if self.output_norm == "l2":
            x = nn.functional.normalize(x, dim=-1, eps=EPS)
        return x * keep
