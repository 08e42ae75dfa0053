"""Exact mode in one process (hybridrec.exact, docs/exact.md): its fixed sums, its one-line
refusals, and that every plan of one rank gives the bits of sharding=none (the exchanges'
canonical paths: row-wise rows pooled per id, shared slots sorted, replicas gathered, full-row
statistics folded). The world sizes: tests/distributed/test_exact.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridrec
from hybridrec import EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.distributed.exact_sum import exact_all_reduce, fold_columns, tree_sum
from hybridrec.planner import CachePolicy
from tests.configs import make_config
from tests.libmodel import FEATURES, OPTIMIZERS, B, TwoSided, batches, full_tables, shard_copies


def test_tree_sum_adds_pairs_then_carries_the_odd_one():
    parts = [torch.randn(7, dtype=torch.float32) for _ in range(5)]
    a, b, c, d, e = parts
    assert torch.equal(tree_sum(parts), ((a + b) + (c + d)) + e)
    assert torch.equal(tree_sum(parts[:1]), a)
    with pytest.raises(ValueError, match="at least one"):
        tree_sum([])


def test_fold_columns_is_the_tree_over_columns_whatever_the_rows():
    x = torch.randn(50, 13) * torch.logspace(0, 6, 13)  # magnitudes where order shows
    want = tree_sum(list(x.T))
    assert torch.equal(fold_columns(x), want)
    for i in (0, 17, 49):  # a row alone sums as it does among others
        assert torch.equal(fold_columns(x[i : i + 1]), want[i : i + 1])


def test_exact_all_reduce_on_one_rank_is_the_tree_over_micro_shards():
    parts = torch.randn(6, 11)
    assert torch.equal(exact_all_reduce(parts, None), tree_sum(list(parts)))


@pytest.mark.parametrize(
    "overrides,world,needle",
    [
        (["train.exact_shards=6"], 4, "train.exact_shards=6 must be a positive multiple of the world size 4"),
        (["train.exact_shards=0"], 2, "train.exact_shards=0 must be a positive multiple of the world size 2 .* try train.exact_shards=2$"),
        (["train.exact_shards=9"], 2, "; try train.exact_shards=8 or 10$"),
        (["train.exact_shards=5"], 1, "train.batch_size=1024 must be divisible by train.exact_shards=5"),
        (["eval.batch_size=100"], 1, "eval.batch_size=100 must be divisible by train.exact_shards=8"),
        (["device=cuda"], 1, "runs on the CPU"),
        (["sharding.comm_dtype=bf16"], 1, "sharding.comm_dtype=bf16"),
        (["train.compile=dense"], 1, "train.compile=dense"),
    ],
)  # fmt: skip
def test_exact_config_refusals_name_the_keys(overrides, world, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")) as e:
        make_config("train.exact=true", *overrides, world_size=world)
    assert "\n" not in str(e.value)


def test_parallelize_refuses_micro_shards_the_batch_does_not_split_into():
    with pytest.raises(ValueError, match="batch_size=24 .* exact_shards=5"):
        hybridrec.parallelize(TwoSided(), batch_size=B, sparse_optimizer=None, exact_shards=5)


def _model(sharding: str, sparse: str) -> nn.Module:
    torch.manual_seed(0)
    return hybridrec.parallelize(
        TwoSided(), batch_size=B, sparse_optimizer=OPTIMIZERS[sparse](), sharding=sharding,
        cache=CachePolicy(fraction=0.05), seed=11, exact_shards=4,
    )  # fmt: skip


def _keyed(ids: torch.Tensor) -> KeyedIds:
    names, hotness = zip(*FEATURES, strict=True)
    return KeyedIds(ids, names, hotness)


def _bce(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(out, labels)


def test_a_training_forward_outside_exact_step_is_refused():
    model = _model("none", "sgd")
    dense, ids, labels = batches()[0]
    with pytest.raises(RuntimeError, match="hybridrec.exact_step"):
        model(dense, _keyed(ids))
    with torch.no_grad():  # evaluation takes any batch
        assert model(dense[:5], _keyed(ids[:5])).shape == (5,)
    with pytest.raises(ValueError, match="not parallelized in exact mode"):
        torch.manual_seed(0)
        plain = hybridrec.parallelize(TwoSided(), batch_size=B, sparse_optimizer=None)
        hybridrec.exact_step(plain, _bce, dense, _keyed(ids), labels)


class _TwoLookups(nn.Module):
    """Looks its table up twice per forward: exact mode takes one lookup per step."""

    def __init__(self) -> None:
        super().__init__()
        self.t = EmbeddingTables([Table("t", 10, 4)], [Feature("f", "t")])

    def forward(self, dense: torch.Tensor, ids: KeyedIds) -> torch.Tensor:
        return (self.t(ids)["f"] + self.t(ids)["f"]).sum(1) + dense.sum(1)


def test_a_second_lookup_in_one_micro_shard_is_refused_in_one_line():
    model = hybridrec.parallelize(
        _TwoLookups(), batch_size=8, sparse_optimizer=OPTIMIZERS["sgd"](), exact_shards=2
    )
    ids = KeyedIds(torch.arange(8).view(8, 1), ["f"], [1])
    with pytest.raises(ValueError, match="looked up twice in one micro-shard"):
        hybridrec.exact_step(model, _bce, torch.zeros(8, 1), ids, torch.zeros(8))


def _train(sharding: str, sparse: str, steps: int = 3) -> dict:
    model = _model(sharding, sparse)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for dense, ids, labels in batches()[:steps]:
        losses.append(hybridrec.exact_step(model, _bce, dense, _keyed(ids), labels))
        opt.step()
        opt.zero_grad()
    return {
        "losses": torch.stack(losses),
        "shards": shard_copies(model),
        "dense": {k: v.detach().clone() for k, v in model.named_parameters()},
    }


@pytest.mark.parametrize(
    "sharding,sparse",
    [("row_wise", "adam"), ("column_wise", "rowwise_adagrad"), ("data_parallel", "adagrad"),
     ("host", "rowwise_adagrad")],
)  # fmt: skip
def test_every_plan_of_one_rank_gives_the_bits_of_sharding_none(sharding, sparse):
    """One rank's all-to-all (row-wise rows pooled per id, replicas from the gathered batch,
    host caches) against the sample-major lookup of sharding=none; the user table is shared
    by two features (its ids sorted into canonical order)."""
    want, got = _train("none", sparse), _train(sharding, sparse)
    assert torch.equal(got["losses"], want["losses"])
    for table, entries in full_tables([want]).items():
        for name, value in entries.items():
            assert torch.equal(full_tables([got])[table][name], value), f"{table}.{name}"
    for k, v in want["dense"].items():
        assert torch.equal(got["dense"][k], v), k
