"""What the row-kernel tests share (test_cpu_rows, test_native_rows, test_new_optimizer,
test_weight_decay): a batch of ids in bags with its pooled gradient, an optimizer's random
state, two equal fused groups, a bit-for-bit comparison, and the optimizers they run. A plain
module, so that test modules never import each other."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridrec.optim.sparse import (
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseOptimizer,
    SparseSGD,
)
from hybridrec.sparse.fused import FusedEmbedding
from hybridrec.types import ShardSpec, TableConfig

OPTIMIZERS = {
    "sgd": lambda: SparseSGD(0.05),
    "adagrad": lambda: SparseAdagrad(0.05),
    "rowwise_adagrad": lambda: RowWiseAdagrad(0.05),
    "adam": lambda: SparseAdam(0.01),
}


def bag_batch(n: int, rows: int, bags: int, width: int, seed: int, hot: int = 0):  # noqa: ANN201
    """n ids in [0, rows) (with `hot` > 0: most ids among the first `hot` rows, many repeats),
    their bags in [0, bags) non-decreasing, and a pooled gradient [bags, width]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (n,), generator=g)
    if hot:
        ids = torch.where(torch.rand(n, generator=g) < 0.8, ids % hot, ids)
    bag = torch.randint(0, bags, (n,), generator=g).sort().values
    return ids, bag, torch.randn(bags, width, generator=g)


def random_state(opt: SparseOptimizer, rows: int, width: int) -> dict[str, torch.Tensor]:
    """`opt`'s state for `rows` rows of `width`, uniform in [0, 1): row-wise state [rows],
    element-wise [rows, width] (also at width 1), as its declaration says."""
    return {k: torch.rand(kind.shape(rows, width)) for k, kind in opt.state_spec().items()}


def two_table_groups(make: Callable[[], SparseOptimizer]) -> tuple[FusedEmbedding, FusedEmbedding]:
    """Two equal fused groups (one to test, one the reference) of two tables of width 8, 50 and
    400 rows, each with its own optimizer `make()`."""
    tables = [TableConfig(f"t{i}", n, 8) for i, n in enumerate((50, 400))]
    shards = [(t, i, ShardSpec(t.name, 0, 0, t.num_rows, 0, 8)) for i, t in enumerate(tables)]
    return FusedEmbedding(shards, make()), FusedEmbedding(shards, make())


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Assert that `a` and `b` hold the same dtype, shape and bits (`what` names them)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    same = a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))
    assert same, f"{what}: {(a.float() - b.float()).abs().max().item()} apart"
