"""Sequence features (Pooling.NONE) in one process: the lookup gives each position its id's
row (zeros where the column holds -1), both exchanges of one rank agree bit for bit, and the
backward sums each row's gradients over positions and samples as a plain nn.Embedding does."""

from __future__ import annotations

import pytest
import torch

from hybridrec import EmbeddingTables, Feature, Table
from hybridrec.model.tables import Pooled
from hybridrec.optim import SparseAdam, SparseSGD
from hybridrec.sparse.collection import EmbeddingCollection
from hybridrec.sparse.exchange.sample_major import SampleMajor
from hybridrec.types import Pooling, TableConfig

IDS = torch.tensor(
    [
        [1, 2, 3, -1, -1, 5, 0, -1],  # a history of 3, a target, a list of 1 tag
        [4, -1, 6, 7, 8, 9, 3, 2],  # a gap inside the history
        [-1, -1, -1, -1, -1, 1, -1, -1],  # an empty history and no tags
    ]
)


def features(tag_width: int) -> list[TableConfig]:
    return [
        TableConfig("history", 20, 4, hotness=5, pooling=Pooling.NONE, storage="item"),
        TableConfig("target", 20, 4, storage="item"),
        TableConfig("tags", 7, tag_width, hotness=2, pooling=Pooling.MEAN, jagged=True),
    ]


def test_a_sequence_feature_is_always_jagged_and_has_a_row_per_position():
    t = TableConfig("h", 10, 4, hotness=6, pooling="none")
    assert t.sequence and t.jagged and t.slots == 6
    assert TableConfig("p", 10, 4, hotness=6).slots == 1


@pytest.mark.parametrize("tag_width", [4, 8])  # one width (sample-major) and mixed widths
def test_each_position_gets_its_ids_row(tag_width):
    coll = EmbeddingCollection(features(tag_width), SparseSGD(0.1), seed=1)
    assert isinstance(coll.exchange, SampleMajor) == (tag_width == 4)
    weight = coll.shard_views()[0][1]
    with torch.no_grad():
        out = coll(IDS)
    history = out[:, :5] if out.dim() == 3 else out[:, :20].reshape(3, 5, 4)
    for b in range(3):
        for j in range(5):
            i = int(IDS[b, j])
            want = weight[i] if i >= 0 else torch.zeros(4)
            assert torch.equal(history[b, j], want), (b, j)


def test_the_two_exchanges_of_one_rank_agree_bit_for_bit():
    fast = EmbeddingCollection(features(4), SparseAdam(0.1), seed=1)
    slow = EmbeddingCollection(features(4), SparseAdam(0.1), seed=1)
    slow.exchange = slow.all_to_all
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        a, b = fast(IDS), slow(IDS)
        assert torch.equal(a, b)
        w = torch.randn(a.shape, generator=g)
        (a * w).sum().backward()
        (b * w).sum().backward()
    for (_, wa, sa), (_, wb, sb) in zip(fast.shard_views(), slow.shard_views(), strict=True):
        assert torch.equal(wa, wb)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_rows_take_the_sum_of_their_gradients_over_positions_and_samples():
    """SGD on the sequence's rows equals torch's own embedding (padding_idx rows untouched)."""
    coll = EmbeddingCollection(features(4)[:2], SparseSGD(0.5), seed=2)
    start = coll.shard_views()[0][1].clone()
    ref = torch.nn.Parameter(start.clone())
    g = torch.Generator().manual_seed(1)
    ids = IDS[:, :6]
    out = coll(ids)
    w = torch.randn(out.shape, generator=g)
    (out * w).sum().backward()
    cols = ids.clamp(min=0)
    rows = ref[cols] * (ids >= 0).unsqueeze(2)  # [B, 6, 4]
    (rows * w).sum().backward()
    with torch.no_grad():
        ref -= 0.5 * ref.grad
    torch.testing.assert_close(coll.shard_views()[0][1], ref.detach(), rtol=0, atol=1e-6)


def test_the_model_reads_a_sequence_and_its_mask():
    tables = EmbeddingTables(
        [Table("item", 20, 4)],
        [Feature("history", "item", hotness=5, pooling="none"), Feature("target", "item")],
    )
    tables.attach(EmbeddingCollection(tables.features, SparseSGD(0.1)))
    out = tables(IDS[:, :6])
    assert out["history"].shape == (3, 5, 4) and out["target"].shape == (3, 4)
    assert torch.equal(out.mask("history"), IDS[:, :5] >= 0)
    assert torch.equal(out["history"][~out.mask("history")], torch.zeros(8, 4))
    with pytest.raises(KeyError, match="not a sequence"):
        out.mask("target")
    with pytest.raises(ValueError, match="pooling must be sum, mean or none"):
        EmbeddingTables([Table("item", 20, 4)], [Feature("h", "item", 3, pooling="max")])


def test_pooled_reads_features_handed_over_apart_as_it_reads_the_whole():
    """The storage may hand each feature's [B, S_f, D] apart (hybridrec.types.Embedded):
    Pooled gives the same features, masks and whole `tensor` (their cat) as from the whole."""
    feats = features(4)[:2]
    g = torch.Generator().manual_seed(3)
    whole = torch.randn(3, 6, 4, generator=g, requires_grad=True)
    cols = IDS[:, :6]
    apart = Pooled((whole[:, :5], whole[:, 5:]), feats, cols)
    given = Pooled(whole, feats, cols)
    assert torch.equal(apart.tensor, whole) and apart.tensor is apart.tensor
    for name in ("history", "target"):
        assert torch.equal(apart[name], given[name])
    assert apart["target"].shape == (3, 4)
    assert torch.equal(apart.mask("history"), given.mask("history"))
    apart["target"].sum().backward()  # a loss reading one feature reaches only its rows
    assert whole.grad[:, :5].abs().sum() == 0 and torch.equal(whole.grad[:, 5], torch.ones(3, 4))
