"""Vocabularies and id counts: the files' per-table counts merged, one table at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hybridrec.data.criteo import NUM_CAT
from hybridrec.data.encode import SparseCounter, build_vocab
from hybridrec.data.preprocess.options import TOP_IDS


def _top(ids: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    order = np.lexsort((ids, -counts))[:TOP_IDS]
    return [[int(ids[i]), int(counts[i])] for i in order]


def _build_vocabs(work: Path, metas: list[dict], parts: list[Path], min_count: int) -> list[int]:
    """Merge pass-1 counts table by table; write vocabularies and id counts; cardinalities."""
    vocab = work / "vocab"
    vocab.mkdir(exist_ok=True)
    sizes = []
    missing = np.zeros(NUM_CAT, np.int64)
    for p in parts:
        with np.load(p / "values.npz", allow_pickle=False) as z:
            missing += z["missing"]
    for t in range(NUM_CAT):
        counter = SparseCounter(np.uint64)
        for p in parts:
            with np.load(p / "values.npz", allow_pickle=False) as z:
                counter.add_counts(z[f"values_{t}"], z[f"counts_{t}"])
        values, counts = counter.result()
        v = build_vocab(values, counts, min_count)
        np.save(vocab / f"cat_{t}.values.npy", v["values"])
        np.save(vocab / f"cat_{t}.ids.npy", v["ids"].astype(np.int32))
        id_counts = np.concatenate([[missing[t], counts[counts < min_count].sum()], v["counts"]])
        ids = np.flatnonzero(id_counts)
        np.savez(vocab / f"cat_{t}.counts.npz", ids=ids.astype(np.int64), counts=id_counts[ids])
        sizes.append(2 + int(v["values"].size))
    return sizes


def _merge_hash_counts(work: Path, parts: list[Path]) -> None:
    out = work / "vocab"  # same place as vocab mode's counts
    out.mkdir(exist_ok=True)
    for t in range(NUM_CAT):
        counter = SparseCounter(np.int64)
        for p in parts:
            with np.load(p / "counts.npz", allow_pickle=False) as z:
                counter.add_counts(z[f"ids_{t}"], z[f"counts_{t}"])
        ids, counts = counter.result()
        np.savez(out / f"cat_{t}.counts.npz", ids=ids, counts=counts)
