"""hybridrec: hybrid-parallel training of recommender models (model-parallel embedding
tables, data-parallel everything else), exactly equal to one process at any scale.

As a library (docs/library.md): declare `EmbeddingTables` (of `Table`s and the `Feature`s that
look them up) in your own nn.Module, then `parallelize(model, ...)` shards them over the
ranks; feed the model `KeyedIds`; end with `shutdown()`. Retrieval: `retrieval_loss` (a
softmax over every rank's items, given the group), `candidate_ids` (a step's item lookup).
Exact mode (`parallelize(..., exact_shards=M)`, then `exact_step`): the same bits at any world
size (docs/exact.md). As a trainer: `hybridrec-train` (README.md).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "parallelize": "hybridrec.shard",
    "check_inputs": "hybridrec.shard",
    "exact_step": "hybridrec.exact",
    "exact_forward": "hybridrec.exact",
    "shutdown": "hybridrec.distributed.env",
    "EmbeddingTables": "hybridrec.model.tables",
    "Feature": "hybridrec.model.tables",
    "Pooled": "hybridrec.model.tables",
    "Table": "hybridrec.model.tables",
    "Dynamic": "hybridrec.types",
    "KeyedIds": "hybridrec.types",
    "LossBatch": "hybridrec.model.task",
    "candidate_ids": "hybridrec.model.retrieval",
    "retrieval_loss": "hybridrec.train.retrieval",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """The library API, imported on first use (`import hybridrec` stays light)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybridrec' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
