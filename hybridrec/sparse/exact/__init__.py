"""Exact mode's embedding side: every sum over samples in one canonical order (docs/exact.md).

`ExactCollection` (collection.py) is the sharded collection with: the all-to-all's row-wise
bags pooled per id where their samples are (exchange.py), each row's gradient summed in the
canonical order and full-row statistics folded over the whole row (update.py, row_stats.py),
replicated tables updated from the whole global batch (replicas.py). hybridrec.exact trains it.
"""

from hybridrec.sparse.exact.collection import ExactCollection

__all__ = ["ExactCollection"]
