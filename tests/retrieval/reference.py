"""Top-K lists of a trained retrieval model written out in Python: every user of a split
scored against the items given, one by one, for the retrieval tests to compare with."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.retrieval.tables import split_rows


def python_topk(trainer, data: Path, split: str, items: list[int], k: int) -> dict[int, list[int]]:
    """Each user of `split` (val or test) -> its top-k of `items` by <query, candidate>
    (higher first, ties by lower item id), the items it met in the earlier splits (train;
    train and val for test) left out; its query from its first row of the split."""
    seen: dict[int, set[int]] = {}
    for s in ["train"] if split == "val" else ["train", "val"]:
        for u, i, _ in split_rows(data, s):
            seen.setdefault(u, set()).add(i)
    rows = split_rows(data, split)
    model = trainer.model
    model.eval()
    with torch.no_grad():
        vectors = model.candidates(torch.tensor(items)).double()
    out = {}
    for u in dict.fromkeys(r[0] for r in rows):  # order of first appearance
        first = next(r for r in rows if r[0] == u)
        ids = trainer.keyed(torch.tensor([[u, first[1]]]))
        with torch.no_grad():
            q = model.query(torch.tensor([[first[2]]], dtype=torch.float32), ids).double()
        scores = (vectors @ q[0]).tolist()
        left = [n for n in range(len(items)) if items[n] not in seen.get(u, set())]
        out[u] = [items[n] for n in sorted(left, key=lambda n: (-scores[n], items[n]))[:k]]
    return out
