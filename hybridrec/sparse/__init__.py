"""Embedding storage and lookup: fused groups, the sharded collection and its exchanges, and
the interface the trainer uses (hybridrec.sparse.api)."""

from hybridrec.sparse.api import EmbeddingModule, embedding_modules
from hybridrec.sparse.collection import EmbeddingCollection
from hybridrec.sparse.fused import FusedEmbedding, LookupInput, RowOptimizer
from hybridrec.sparse.ids import IdChecker, IdOutOfRangeError

__all__ = [
    "EmbeddingCollection",
    "EmbeddingModule",
    "FusedEmbedding",
    "IdChecker",
    "IdOutOfRangeError",
    "LookupInput",
    "RowOptimizer",
    "embedding_modules",
]
