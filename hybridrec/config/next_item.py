"""Config checks of model.task=next_item (sequence models over data=sequences)."""

from __future__ import annotations

from hybridrec.config.schema import SEQUENCE_ARCHS, Config

NEXT_ITEM_LOSSES = ("bce", "softmax")


def check_sequence_data(task: object, data_name: object) -> None:
    """model.task=next_item reads data=sequences. Checked on the composed config before it
    is typed too: a sequence preset leaves the table keys null for that data to fill."""
    if task == "next_item" and data_name != "sequences":
        raise ValueError(
            "model.task=next_item learns from users' item sequences: it needs data=sequences "
            f"(data.path a `user item` file or an interaction table), not data.name={data_name}"
        )


def check_next_item(c: Config) -> None:
    """model.task=next_item: a sequence model over data=sequences, and back."""
    m, n = c.model, c.train.next_item
    seq_arch = m._target_ is None and m.arch in SEQUENCE_ARCHS
    check_sequence_data(m.task, c.data.name)
    if m.task == "next_item" and m._target_ is None and not seq_arch:
        raise ValueError(
            f"model.task=next_item needs a sequence model: model.arch=sasrec or hstu, or your "
            f"own model._target_ (docs/library.md, Sequences), not model.arch={m.arch}"
        )
    if seq_arch and m.task != "next_item":
        raise ValueError(
            f"model.arch={m.arch} predicts the next item of a sequence: it needs "
            f"model.task=next_item and data=sequences, not model.task={m.task}"
        )
    if c.data.name == "sequences" and m.task != "next_item":
        raise ValueError(
            f"data=sequences holds users' item sequences: train them with model.task=next_item "
            f"(model=sasrec or hstu), not model.task={m.task}"
        )
    sequences = [f.name for f in m.tables() if f.sequence] if m.task != "next_item" else []
    if sequences and m._target_ is None:
        raise ValueError(
            f"model.arch={m.arch} pools every feature: its feature {sequences[0]!r} has "
            "model.pooling=none (a sequence); pool it (sum or mean), or use your own model "
            "(model._target_) that reads sequences"
        )
    if n.loss not in NEXT_ITEM_LOSSES:
        raise ValueError(
            f"train.next_item.loss={n.loss!r} is not one of: {', '.join(NEXT_ITEM_LOSSES)}"
        )
    if n.negatives < (0 if n.loss == "softmax" else 1):
        raise ValueError(
            f"train.next_item.negatives must be >= 1 with loss=bce (the items each position "
            f"is told apart from), got {n.negatives}"
        )
    if c.data.sequence.max_len < 1:
        raise ValueError(f"data.sequence.max_len must be >= 1, got {c.data.sequence.max_len}")
