"""Embedding storage and lookup: fused groups, the sharded collection and its exchanges, and
the interface the trainer uses (hybridrec.sparse.api).

The names below are imported on first use, so that importing a light module of the package
(`hybridrec.sparse.costs`, which the planner reads) loads none of the runtime (the exchanges,
the kernels, torch.distributed).
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "EmbeddingCollection": "hybridrec.sparse.collection",
    "EmbeddingModule": "hybridrec.sparse.api",
    "FusedEmbedding": "hybridrec.sparse.fused",
    "IdChecker": "hybridrec.sparse.ids",
    "IdOutOfRangeError": "hybridrec.sparse.ids",
    "LookupInput": "hybridrec.sparse.fused",
    "RowOptimizer": "hybridrec.sparse.fused",
    "embedding_modules": "hybridrec.sparse.api",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """The package's API, imported on first use (as `hybridrec` does)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybridrec.sparse' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
