"""Optimizers: row-wise sparse ones for embedding tables, torch.optim for the MLPs, and the
learning-rate schedule both follow."""

from hybridrec.optim.dense import build_dense_optimizer
from hybridrec.optim.schedule import LRSchedule
from hybridrec.optim.sparse import (
    SPARSE_OPTIMIZERS,
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseOptimizer,
    SparseSGD,
    build_sparse_optimizer,
)

__all__ = [
    "SPARSE_OPTIMIZERS",
    "LRSchedule",
    "RowWiseAdagrad",
    "SparseAdagrad",
    "SparseAdam",
    "SparseOptimizer",
    "SparseSGD",
    "build_dense_optimizer",
    "build_sparse_optimizer",
]
