"""Embedding storage and lookup: fused groups, the local collection, the sharded collection."""

from hybridrec.sparse.collection import EmbeddingCollection, IdChecker, IdOutOfRangeError
from hybridrec.sparse.fused import FusedEmbedding, LookupInput, RowOptimizer

__all__ = [
    "EmbeddingCollection",
    "FusedEmbedding",
    "IdChecker",
    "IdOutOfRangeError",
    "LookupInput",
    "RowOptimizer",
]
