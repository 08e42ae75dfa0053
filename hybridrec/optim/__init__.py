"""Optimizers: row-wise sparse ones for embedding tables, torch.optim for the MLPs, and the
learning-rate schedule both follow."""

from hybridrec.optim.dense import build_dense_optimizer
from hybridrec.optim.schedule import LRSchedule
from hybridrec.optim.sparse import (
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseSGD,
    build_sparse_optimizer,
)

__all__ = [
    "LRSchedule",
    "RowWiseAdagrad",
    "SparseAdagrad",
    "SparseAdam",
    "SparseSGD",
    "build_dense_optimizer",
    "build_sparse_optimizer",
]
