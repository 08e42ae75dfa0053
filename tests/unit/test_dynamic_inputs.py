"""What a dynamic table takes as ids, in one process (issue 41's tracebacks): an empty batch, ids
of any integer dtype (as fixed tables take them: the same rows as int64), float ids refused in
one line naming the feature (before any kernel reads them: a float id reached the C map and
corrupted the heap), and the top of the raw id range named truly (2^63 - 1 is not negative)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridrec
from hybridrec import Dynamic, EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.kernels.hashing import bucket_of
from hybridrec.optim.sparse import SparseSGD
from hybridrec.sparse.collection import EmbeddingCollection
from hybridrec.sparse.ids import RAW_ID_MAX, IdDtypeError, IdOutOfRangeError
from hybridrec.types import TableConfig

# one width: the sample-major group (DLRM's path); two widths: the all-to-all exchange
TABLES = {
    "sample_major": [
        TableConfig("u", 64, 4, dynamic=Dynamic(buckets=4)),
        TableConfig("f", 10, 4),
        TableConfig("l", 32, 4, hotness=3, jagged=True, dynamic=Dynamic(buckets=4, unknown="row")),
    ],
    "exchange": [
        TableConfig("u", 64, 4, dynamic=Dynamic(buckets=4)),
        TableConfig("f", 10, 8),
        TableConfig("l", 32, 4, hotness=3, jagged=True, dynamic=Dynamic(buckets=4, unknown="row")),
    ],
}
IDS = torch.tensor([[1, 2, 3, -1, 4], [3, 2, 1, 1, -1], [5, 5, 5, 6, 7], [7, 7, 7, -1, -1]])


def _collection(path: str, training: bool) -> EmbeddingCollection:
    c = EmbeddingCollection(TABLES[path], SparseSGD(0.1), seed=3)
    return c.train(training)


@pytest.mark.parametrize("path", list(TABLES))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_an_empty_batch_looks_up_nothing(path, training):
    """Was `cannot reshape tensor of 0 elements` (remap.py at 56fa775): now [0, ...] out, no
    admission, and the next batch is looked up as without it."""
    c, ref = _collection(path, training), _collection(path, training)
    with torch.set_grad_enabled(training):
        out = c(IDS[:0])
        assert out.shape[0] == 0
        if training:
            out.sum().backward()
        torch.testing.assert_close(c(IDS), ref(IDS), rtol=0, atol=0)


class Holder(nn.Module):
    """A model holding TABLES[path] as EmbeddingTables (the library's and the trainer's way
    in), its features named as the tables."""

    def __init__(self, path: str) -> None:
        super().__init__()
        tables = TABLES[path]
        self.tables = EmbeddingTables(
            [Table(t.name, t.num_rows, t.dim, dynamic=t.dynamic) for t in tables],
            [Feature(t.name, t.name, hotness=t.hotness, jagged=t.jagged) for t in tables],
            namespace="",
        )

    def forward(self, ids: KeyedIds) -> torch.Tensor:
        return self.tables(ids).tensor


def _model(path: str, training: bool) -> nn.Module:
    model = hybridrec.parallelize(
        Holder(path), batch_size=4, sparse_optimizer=SparseSGD(0.1), sharding="none", seed=3
    )
    return model.train(training)


@pytest.mark.parametrize("path", list(TABLES))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8])
def test_integer_ids_of_any_width_look_up_the_rows_of_int64_ids(path, dtype):
    """int32 ids failed in the exchange's counts (index_put_ of int64 into int32) and hashed
    to other buckets (the hash wrapped at 32 bits): they are widened first."""
    ids = IDS.clamp(min=0) if dtype == torch.uint8 else IDS
    names, hotness = [t.name for t in TABLES[path]], [t.hotness for t in TABLES[path]]
    for training in (True, False):
        with torch.set_grad_enabled(training):
            got = _model(path, training)(KeyedIds(ids.to(dtype), names, hotness))
            want = _model(path, training)(KeyedIds(ids, names, hotness))
        assert torch.equal(got, want), (dtype, training)


def test_a_narrow_ids_hash_is_its_int64_hash():
    ids = torch.arange(-1, 3000)
    for dtype in (torch.int32, torch.int16):
        assert torch.equal(bucket_of(ids.to(dtype), 7), bucket_of(ids, 7))
    assert torch.equal(bucket_of(ids[1:256].to(torch.uint8), 5), bucket_of(ids[1:256], 5))


@pytest.mark.parametrize("path", list(TABLES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_ids_that_are_not_integers_are_refused_naming_the_feature(path, dtype):
    for training in (True, False):
        with pytest.raises(IdDtypeError) as e, torch.set_grad_enabled(training):
            _collection(path, training)(IDS.to(dtype))
        name = str(dtype).removeprefix("torch.")
        assert str(e.value).startswith(
            f"feature 0 (u) and the other 2 features: ids are {name}, not integers (a dynamic "
            "table's raw ids are int64); pass int64 ids (int32, int16, int8 and uint8 are taken "
            "too)"
        ), e.value


def test_the_largest_int64_is_named_above_the_raw_id_range_not_negative():
    ids = IDS.clone()
    ids[2, 0] = (1 << 63) - 1
    with pytest.raises(IdOutOfRangeError) as e:
        _collection("exchange", True)(ids)
    assert str(e.value) == (
        "feature 0 (u): id 9223372036854775807 at sample 2 is above 9223372036854775806 "
        "(2^63 - 2); dynamic table 'u' takes raw ids 0..9223372036854775806"
    )
    ids[2, 0] = RAW_ID_MAX  # the largest raw id is taken
    _collection("exchange", True)(ids)
    ids[1, 0] = -3
    with pytest.raises(IdOutOfRangeError, match="id -3 at sample 1 is negative; dynamic table"):
        _collection("exchange", False)(ids)
