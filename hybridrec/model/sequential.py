"""Next-item models over a user's item sequence (model.arch=sasrec | hstu, model.task=next_item):
an item table looked up as sequences (sharded like any table, a row per event through the
exchanges) and an encoder (hybridrec.model.sasrec.SASRec or hybridrec.model.hstu.HSTU).

    model = NextItemModel(features, encoder="sasrec", blocks=2, heads=1, dropout=0.2)
    out = model(dense, ids)                    # training: NextItemOutputs
    states = model.query(dense, ids)           # [B, D] each user's state after its inputs
    vectors = model.candidates(item_ids)       # [n, D] items' vectors (the table's rows)

`features`: the data's (hybridrec.data.sequence_source): `seq` [L + 1], a sequence of the item
table (positions 0..L-1 are read, 1..L predicted), and for the sampled BCE objective `neg`
[L * N], N items per position. The score of item j after position i is <hidden[i], row_j>
(the table's row: SASRec's shared item embedding). The model imports no collective: the
softmax objective that gathers every rank's items is hybridrec.train.next_item's.

One lookup per step (the contract that keeps host caches' staging exact, as retrieval's): the
training forward's optional uniform `negatives` [M] (the same on every rank) ride the same
call as extra rows of `seq` (`with_negative_rows`); `query` and `candidates` each make one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridrec.model.hstu import HSTU
from hybridrec.model.next_item import last_states
from hybridrec.model.sasrec import SASRec
from hybridrec.model.tables import EmbeddingTables
from hybridrec.types import PAD_ID, KeyedIds, TableConfig

ENCODERS = {"sasrec": SASRec, "hstu": HSTU}


@dataclass(frozen=True)
class NextItemOutputs:
    """What the next-item objectives read (hybridrec.model.next_item, train.next_item):
    hidden [B, L, D] states after each input position, positives [B, L, D] the rows of each
    position's next item, target_ids [B, L] (-1: none), mask [B, L] the positions that train,
    negatives [B, L, N, D] (sampled BCE) or [M, D] (the step's uniform ones) or None, and
    negative_ids [M] for the latter."""

    hidden: torch.Tensor
    positives: torch.Tensor
    target_ids: torch.Tensor
    mask: torch.Tensor
    negatives: torch.Tensor | None = None
    negative_ids: torch.Tensor | None = None


def encode_grouped(
    encoder: nn.Module, rows: torch.Tensor, mask: torch.Tensor, groups: int
) -> torch.Tensor:
    """encoder(rows [B, L, D], mask [B, L]), computed on `groups` groups of rows of similar
    lengths, each cut to its longest: rows are independent and a causal encoder's output at
    an event never reads the PAD positions after it, so the cut columns only save work
    (most histories are far shorter than L). Positions past a row's events are zeros, as the
    encoders give them. One host read of the lengths (a sync on CUDA)."""
    lengths = mask.sum(1)
    longest = lengths.tolist()
    if groups <= 1 or max(longest, default=0) == mask.shape[1] and min(longest) == max(longest):
        return encoder(rows, mask)
    order = torch.argsort(lengths, stable=True)
    out = rows.new_zeros(rows.shape)
    for part in order.chunk(groups):
        w = max(int(lengths[part].max()), 1)
        out[part, :w] = encoder(rows[part, :w], mask[part, :w])
    return out


def with_negative_rows(seq: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
    """seq ids [B, C] with negatives [M] appended as ceil(M / C) more rows (-1 past them):
    one lookup gives both. The rows' order is the negatives' order."""
    width = seq.shape[1]
    extra = -(-negatives.numel() // width)
    rows = seq.new_full((extra * width,), PAD_ID)
    rows[: negatives.numel()] = negatives.to(seq.device, seq.dtype)
    return torch.cat([seq, rows.view(extra, width)])


class NextItemModel(nn.Module):
    """An item table, looked up as sequences, and a sequence encoder (module docstring)."""

    task = "next_item"

    def __init__(
        self,
        features: Sequence[TableConfig],
        encoder: str = "sasrec",
        groups: int = 4,
        **encoder_args: object,
    ) -> None:
        """`groups`: a batch's rows run through the encoder in this many groups of similar
        lengths (encode_grouped; 1: all together)."""
        super().__init__()
        by_name = {f.name: f for f in features}
        seq = by_name.get("seq")
        if seq is None or not seq.sequence or seq.hotness < 2:
            raise ValueError(
                "a next-item model reads a sequence feature `seq` of at least 2 positions "
                "(data=sequences gives it)"
            )
        if encoder not in ENCODERS:
            raise ValueError(f"encoder={encoder!r} is not one of: {', '.join(ENCODERS)}")
        self.max_len, self.groups = seq.hotness - 1, groups
        neg = by_name.get("neg")
        self.per_position = neg.hotness // self.max_len if neg is not None else 0
        self.items = EmbeddingTables.of([f for f in features if f.name in ("seq", "neg")],
                                        namespace="")  # fmt: skip
        self.feature_names = self.items.feature_names
        try:
            self.encoder = ENCODERS[encoder](seq.dim, self.max_len, **encoder_args)
        except TypeError as e:  # a keyword the encoder does not take: name it
            raise ValueError(f"{encoder}'s arguments (model.args): {e}") from None

    def _rows(self, ids: KeyedIds | torch.Tensor, extra: torch.Tensor | None = None):  # noqa: ANN202
        """(seq rows [B, L + 1, D], seq ids [B, L + 1], neg rows or None, extra rows [M, D]):
        one lookup of the batch (and `extra` item ids as rows of `seq`)."""
        cols = self.items.select(ids) if isinstance(ids, KeyedIds) else ids
        b, width = cols.shape[0], self.max_len + 1
        if extra is not None:
            assert not self.per_position, "uniform negatives are the softmax's, not the BCE's"
            cols = with_negative_rows(cols, extra)
        out = self.items(cols)
        rows = out["seq"]
        neg = out["neg"][:b] if self.per_position else None
        extra_rows = (
            rows[b:].reshape(-1, rows.shape[-1])[: extra.numel()] if extra is not None else None
        )
        return rows[:b], cols[:b, :width], neg, extra_rows

    def forward(
        self, dense: torch.Tensor, ids: KeyedIds, negatives: torch.Tensor | None = None
    ) -> NextItemOutputs:
        """Training: states after every input position and what the objective compares them
        with; `negatives` [M]: the step's uniform items (softmax objective)."""
        rows, seq, neg, extra = self._rows(ids, negatives)
        mask = seq >= 0
        hidden = encode_grouped(self.encoder, rows[:, :-1], mask[:, :-1], self.groups)
        targets = seq[:, 1:]
        train = mask[:, :-1] & (targets >= 0)
        b, length, dim = hidden.shape
        if neg is not None:
            neg = neg.view(b, length, self.per_position, dim)
            return NextItemOutputs(hidden, rows[:, 1:], targets, train, neg)
        return NextItemOutputs(hidden, rows[:, 1:], targets, train, extra, negatives)

    def query(self, dense: torch.Tensor, ids: KeyedIds) -> torch.Tensor:
        """[B, D]: each user's state after the last of its input events (positions 0..L-1 of
        `seq`; ValueError for a user without one)."""
        rows, seq, _, _ = self._rows(ids)
        mask = seq[:, :-1] >= 0
        return last_states(encode_grouped(self.encoder, rows[:, :-1], mask, self.groups), mask)

    def candidates(self, item_ids: torch.Tensor) -> torch.Tensor:
        """[n, D]: the vectors items `item_ids` [n] are scored by (their rows)."""
        width = self.max_len + 1
        cols = with_negative_rows(item_ids.new_empty(0, width), item_ids)
        if self.per_position:  # the lookup reads every feature's columns: -1 for neg
            cols = torch.cat(
                [cols, cols.new_full((cols.shape[0], self.max_len * self.per_position), PAD_ID)], 1
            )
        return self.items(cols)["seq"].reshape(-1, self.items.tables[0].dim)[: item_ids.numel()]


class SASRecModel(NextItemModel):
    """model.arch=sasrec: NextItemModel with SASRec's encoder (model.args: blocks, heads,
    dropout, positions, scale_rows)."""

    def __init__(
        self, features: Sequence[TableConfig], groups: int = 4, **encoder_args: object
    ) -> None:
        super().__init__(features, "sasrec", groups, **encoder_args)


class HSTUModel(NextItemModel):
    """model.arch=hstu: NextItemModel with HSTU's encoder (model.args: blocks, heads, dqk,
    dv, dropout, attn_dropout, positions, output_norm)."""

    def __init__(
        self, features: Sequence[TableConfig], groups: int = 4, **encoder_args: object
    ) -> None:
        super().__init__(features, "hstu", groups, **encoder_args)
