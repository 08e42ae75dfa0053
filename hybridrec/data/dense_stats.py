"""A spec dataset's dense statistics: the mean and standard deviation `standardize` applied.

Preprocessing (hybridrec.data.tabular) standardizes a column with the statistics of its
train split, recorded in the manifest (`schema.dense.columns`: `train_mean`, `train_std`,
the ones applied), or with those of an earlier dataset (`hybridrec-preprocess --stats-from
DIR`), so that one spec gives one input for one raw value day after day. Checkpoints record
their training data's statistics (hybridrec.train.resume), and a resume on data standardized
with others is warned about, naming the columns: `differences`.

`dataset_fingerprint` tells one dataset from another at the same path (a checkpoint's run
continues only on its own data: hybridrec.train.resume, train.count_from).

Torch-free; reads manifests only.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hybridrec.data.manifest import Manifest


def dense_stats(manifest: Manifest) -> list[dict[str, Any]] | None:
    """[{column, transform, mean, std}] per dense column, as applied; None for a dataset
    that records none (Criteo's fast parser: log1p, no statistics)."""
    columns = ((manifest.schema or {}).get("dense") or {}).get("columns")
    if columns is None:
        return None
    return [
        {
            "column": c["column"],
            "transform": c["transform"],
            "mean": float(c["train_mean"]),
            "std": float(c["train_std"]),
        }
        for c in columns
    ]


def read_dense_stats(path: str | Path) -> list[dict[str, Any]] | None:
    """dense_stats of the dataset directory `path`; None when it is none (or unreadable: a
    missing dataset is reported by whoever opens it)."""
    try:
        return dense_stats(Manifest.load(path))
    except (ValueError, KeyError, TypeError):
        return None


def dataset_fingerprint(path: str | Path) -> str | None:
    """The fingerprint of the dataset directory `path` (its inputs, spec and options: a new
    day's data preprocessed into the same path has another); None when it has no manifest."""
    try:
        return Manifest.load(path).fingerprint
    except (ValueError, KeyError, TypeError):
        return None


def differences(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[str]:
    """What differs between two dense_stats in what a model sees: columns or transforms, and
    the statistics of a `standardize` column ('age mean 32.07 -> 37.67, std 9.1 -> 8.8');
    [] when a raw value gives the same input under both."""
    if [(c["column"], c["transform"]) for c in saved] != [
        (c["column"], c["transform"]) for c in current
    ]:
        return [
            "columns "
            + ", ".join(f"{c['column']} ({c['transform']})" for c in saved)
            + " -> "
            + ", ".join(f"{c['column']} ({c['transform']})" for c in current)
        ]
    out = []
    for a, b in zip(saved, current, strict=True):
        if a["transform"] != "standardize":
            continue
        same = all(math.isclose(a[k], b[k], rel_tol=1e-12, abs_tol=0) for k in ("mean", "std"))
        if not same:
            out.append(
                f"{a['column']} mean {a['mean']:.6g} -> {b['mean']:.6g}, std {a['std']:.6g} "
                f"-> {b['std']:.6g}"
            )
    return out
