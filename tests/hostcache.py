"""What the host-cache unit tests share: a group of two shards of different tables, its sparse
optimizers, batches of skewed ids, a step, a lookup, and the checks that a host-cached group
equals the device group it mirrors and keeps a consistent free list. A plain module, so that
test modules never import each other."""

from __future__ import annotations

import dataclasses

import torch

from hybridrec.optim import RowWiseAdagrad, SparseAdagrad, SparseAdam, SparseSGD
from hybridrec.sparse.bags import regular_bags
from hybridrec.sparse.fused import FusedEmbedding, LookupInput
from hybridrec.sparse.host import (
    HostCachedEmbedding,
)
from hybridrec.types import Pooling, ShardSpec, TableConfig

T0 = TableConfig("t0", num_rows=300, dim=8, hotness=2)
T1 = TableConfig("t1", num_rows=120, dim=8, hotness=1, pooling=Pooling.MEAN)
SHARDS = [
    (T0, 0, ShardSpec("t0", 0, 0, 300, 0, 8)),
    (T1, 1, ShardSpec("t1", 0, 20, 120, 0, 8)),  # a row range: ids relative to the shard
]


BATCH = 16


def group_shards(width: int) -> list[tuple[TableConfig, int, ShardSpec]]:
    """SHARDS with tables of another width (1: element-wise state [R, 1], cached as [C, 1])."""
    return [
        (dataclasses.replace(t, dim=width), i, dataclasses.replace(s, col_end=width))
        for t, i, s in SHARDS
    ]


def row_optimizers():
    return {
        "sgd": lambda: SparseSGD(0.1),
        "rowwise_adagrad": lambda: RowWiseAdagrad(0.1),
        "adam": lambda: SparseAdam(0.01),
        "adagrad": lambda: SparseAdagrad(0.1),
    }


def skewed_batch(g: torch.Generator) -> list[LookupInput]:
    # skewed ids, so some rows stay hot and others come and go
    a = (torch.rand(BATCH * 2, generator=g) ** 3 * 300).long()
    b = (torch.rand(BATCH, generator=g) ** 2 * 100).long()
    return [
        LookupInput(a, regular_bags(BATCH, 2, a.device), BATCH),
        LookupInput(b, regular_bags(BATCH, 1, b.device), BATCH, 1.0),
    ]


def train_step(group, inputs, coeff):
    out = group(inputs)
    sum((o * c).sum() for o, c in zip(out, coeff, strict=True)).backward()
    return [o.detach() for o in out]


def group_lookup(group, flat, prefetched=None) -> list[torch.Tensor]:  # noqa: ANN001
    """The lookup of flattened inputs (group.flatten(inputs)) as the sharded collection makes
    it, with what group.prefetch(those rows) returned, if it did: one output per input."""
    rows, bags, scale, sizes = flat
    out = group.lookup(rows, bags, scale, sum(sizes), prefetched=prefetched)
    return list(torch.split(out, sizes))


def assert_same_rows(host: HostCachedEmbedding, ref: FusedEmbedding) -> None:
    host.flush()
    assert torch.equal(host.weight, ref.weight)
    for name, value in ref.state().items():
        assert torch.equal(host.state()[name], value), name


def assert_free_list(host: HostCachedEmbedding) -> None:
    """The free slots the group takes from (tracked without reading the device) are exactly
    the slots that hold no row, each once, and their count is right."""
    host._wait()
    free = (host.row_of_slot < 0).nonzero().squeeze(1)
    assert host._n_free == host._free_slots.numel() == free.numel()
    assert torch.equal(host._free_slots.sort().values, free)
    used = host.row_of_slot >= 0
    assert torch.equal(host.slot_of[host.row_of_slot[used]].long(), used.nonzero().squeeze(1))
