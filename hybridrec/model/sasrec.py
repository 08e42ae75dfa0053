"""SASRec's encoder: causal self-attention over a user's item sequence (Kang and McAuley,
"Self-Attentive Sequential Recommendation", ICDM 2018), in the pre-LN form of the public
SASRec.pytorch (`norm_first`).

    encoder = SASRec(dim=50, max_len=50, blocks=2, heads=1, dropout=0.5)
    hidden = encoder(rows, mask)     # rows [B, L, D], mask [B, L] bool -> hidden [B, L, D]

Input contract (the engine's sequence lookup, hybridrec.data.sequences.last_events):
left-aligned, position 0 the oldest event, positions past a sequence's length PAD
(mask False, their rows zeros); L <= max_len. hidden[b, i] reads only events 0..i of row b
(causal) and never a PAD event; PAD positions' outputs are zeros and must not be used (the
objectives mask them). hidden[b, i] is the user's state after event i: its dot product with
an item's row scores that item as event i + 1.

The layer, as SASRec.pytorch's norm_first variant: x = rows * sqrt(D) (`scale_rows`) +
position embedding, dropout, zeroed at PAD; then per block
    x = x + Attention(LN(x))            (causal, PAD keys masked, dropout on the weights)
    x = x + FFN(LN(x))                  (Linear, dropout, ReLU, Linear, dropout)
    x = x * mask
and a final LayerNorm. LayerNorms use eps 1e-8 as the original code.

Positions (`positions`): "from_end" indexes event i of a sequence of length n by
max_len - n + i, so the most recent event always has position max_len - 1: what the paper's
implementations compute on their left-padded arrays (the last event at the last slot);
"from_start" indexes it by i. The attention runs in torch's scaled_dot_product_attention
(fused kernels on CUDA; an exact math path on the CPU).
"""

from __future__ import annotations

import math

import torch
from torch import nn

POSITIONS = ("from_end", "from_start")


def check_sequence_input(rows: torch.Tensor, mask: torch.Tensor, max_len: int, name: str) -> None:
    """ValueError (one line) unless rows [B, L, D] and mask [B, L] bool agree and L <=
    max_len."""
    if rows.dim() != 3 or mask.shape != rows.shape[:2] or mask.dtype != torch.bool:
        raise ValueError(
            f"{name}: expects rows [B, L, D] and a bool mask [B, L]; got rows "
            f"{list(rows.shape)} and mask {list(mask.shape)} {mask.dtype}"
        )
    if rows.shape[1] > max_len:
        raise ValueError(
            f"{name}: sequences of {rows.shape[1]} positions exceed max_len={max_len}; keep the "
            "most recent max_len events (hybridrec.data.sequences.last_events)"
        )


def position_ids(mask: torch.Tensor, max_len: int, positions: str) -> torch.Tensor:
    """[B, L] int64 position of each event (module docstring, Positions); PAD positions get
    an index in range whose embedding is masked out."""
    i = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    if positions == "from_start":
        return i
    lengths = mask.sum(1, keepdim=True)
    return (max_len - lengths + i).clamp(max=max_len - 1)


def attention_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] bool, True where query i may read key j: j <= i and key j is an event.
    A PAD query reads itself alone, so no row is empty (no NaN); its output is dropped."""
    length = mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    allowed = causal & mask[:, None, :]
    eye = torch.eye(length, dtype=torch.bool, device=mask.device)
    allowed = allowed | (eye & ~mask[:, :, None])
    return allowed.unsqueeze(1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (as torch.nn.MultiheadAttention: one input projection
    with bias, one output projection, dropout on the attention weights)."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"SASRec: dim={dim} is not a multiple of heads={heads}")
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """x [B, L, D], allowed [B, 1, L, L] bool -> [B, L, D]."""
        b, length, dim = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, dim // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D/H]
        drop = self.dropout if self.training else 0.0
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=drop)
        return self.out(y.transpose(1, 2).reshape(b, length, dim))


class SASRecBlock(nn.Module):
    """One pre-LN block (module docstring)."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim, eps=1e-8)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ffn_norm = nn.LayerNorm(dim, eps=1e-8)
        self.ffn = nn.Sequential(
            nn.Linear(dim, dim),
            nn.Dropout(dropout),
            nn.ReLU(),
            nn.Linear(dim, dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x [B, L, D]; allowed: attention_mask's; keep [B, L, 1] float (1 at events)."""
        x = x + self.attn(self.attn_norm(x), allowed)
        x = x + self.ffn(self.ffn_norm(x))
        return x * keep


class SASRec(nn.Module):
    """SASRec's block stack (module docstring): rows [B, L, D] and mask [B, L] -> hidden
    [B, L, D]. The item rows come from the caller (an nn.Embedding, or a sharded table's
    sequence lookup), so the item table is not a parameter here."""

    def __init__(
        self,
        dim: int,
        max_len: int,
        blocks: int = 2,
        heads: int = 1,
        dropout: float = 0.2,
        positions: str = "from_end",
        scale_rows: bool = True,
    ) -> None:
        super().__init__()
        if positions not in POSITIONS:
            raise ValueError(f"SASRec: positions={positions!r} is not one of {POSITIONS}")
        self.dim, self.max_len, self.positions = dim, max_len, positions
        self.scale = math.sqrt(dim) if scale_rows else 1.0
        self.position = nn.Embedding(max_len, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(SASRecBlock(dim, heads, dropout) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim, eps=1e-8)

    def forward(self, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        check_sequence_input(rows, mask, self.max_len, "SASRec")
        keep = mask.unsqueeze(-1).to(rows.dtype)
        x = rows * self.scale + self.position(position_ids(mask, self.max_len, self.positions))
        x = self.drop(x) * keep
        allowed = attention_mask(mask)
        for block in self.blocks:
            x = block(x, allowed, keep)
        return self.norm(x) * keep
