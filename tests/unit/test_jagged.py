"""Jagged (variable-length) bags and per-table widths in one process, against torch.

The one-rank collection takes ids [B, H] whose jagged tables' columns are padded with -1; the
reference is one nn.EmbeddingBag(sparse=True) per table fed the same bags in torch's own
jagged form (values + offsets), with torch.optim.SGD / SparseAdam. Bags of 0..k ids (empty
ones included), sum and mean pooling, widths 4 and 8 side by side, a step where one table
gets no id at all (lazy Adam's bias correction still counts it, as torch's SparseAdam does).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridrec.optim import SparseAdam, SparseSGD
from hybridrec.sparse import EmbeddingCollection, IdOutOfRangeError
from hybridrec.sparse.bags import bag_ids
from hybridrec.types import PAD_ID, TableConfig

TABLES = (
    TableConfig("user", 30, 8, 1),
    TableConfig("genres", 12, 4, 3, "mean", jagged=True),
    TableConfig("history", 40, 8, 5, "sum", jagged=True),
)
# one width: one fused group over every table, looked up sample-major (sparse.exchange.sample_major)
ONE_WIDTH = tuple(dataclasses.replace(t, dim=8) for t in TABLES)
B = 7


def jagged_ids(g: torch.Generator, empty_history: bool = False) -> torch.Tensor:
    """ids [B, 9]: user, then up to 3 genres, then up to 5 history ids, padded with -1."""
    cols = []
    for t in TABLES:
        ids = torch.randint(0, t.num_rows, (B, t.hotness), generator=g)
        if t.jagged:
            length = torch.randint(0, t.hotness + 1, (B, 1), generator=g)
            length[0] = 0  # always one empty bag
            if empty_history and t.name == "history":
                length.zero_()
            ids = ids.masked_fill(torch.arange(t.hotness) >= length, PAD_ID)
        cols.append(ids)
    return torch.cat(cols, dim=1)


def reference_pool(tables, refs: list[torch.nn.EmbeddingBag], ids: torch.Tensor) -> torch.Tensor:
    """torch's jagged form: per table, the real ids and each bag's offset."""
    out, a = [], 0
    for t, ref in zip(tables, refs, strict=True):
        cols = ids[:, a : a + t.hotness]
        a += t.hotness
        present = cols >= 0
        lengths = present.sum(1)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        out.append(ref(cols[present], offsets))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("tables", [TABLES, ONE_WIDTH], ids=["mixed_widths", "one_width"])
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_jagged_bags_match_embedding_bag(name, tables):
    opt = SparseSGD(0.3) if name == "sgd" else SparseAdam(0.05, eps_form="sparse_adam")
    coll = EmbeddingCollection(tables, opt, seed=3)
    width = sum(t.dim for t in tables)
    refs = [
        torch.nn.EmbeddingBag(t.num_rows, t.dim, mode=t.pooling.value, sparse=True) for t in tables
    ]
    views = {spec.table: w for spec, w, _ in coll.shard_views()}
    with torch.no_grad():
        for t, ref in zip(tables, refs, strict=True):
            ref.weight.copy_(views[t.name])
    params = [r.weight for r in refs]
    ref_opt = (
        torch.optim.SGD(params, lr=0.3)
        if name == "sgd"
        else torch.optim.SparseAdam(params, lr=0.05)
    )
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        ids = jagged_ids(g, empty_history=step == 2)
        coeff = torch.randn(B, width, generator=g)
        out = coll(ids)
        # mixed widths: [B, sum D] in table order; one width: [B, T, D]
        assert out.shape == ((B, width) if tables is TABLES else (B, 3, 8))
        out = out.reshape(B, width)
        want = reference_pool(tables, refs, ids)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(out[0, 8:], torch.zeros(width - 8))  # empty bags pool to zeros
        (out * coeff).sum().backward()
        ref_opt.zero_grad()
        (want * coeff).sum().backward()
        ref_opt.step()
    views = {spec.table: (w, st) for spec, w, st in coll.shard_views()}
    for t, ref in zip(tables, refs, strict=True):
        w, state = views[t.name]
        torch.testing.assert_close(w, ref.weight.detach(), rtol=1e-5, atol=1e-6)
        if name == "adam":
            ref_state = ref_opt.state[ref.weight]
            assert int(ref_state["step"]) == 5 == coll.sparse_step
            torch.testing.assert_close(state["exp_avg"], ref_state["exp_avg"], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(
                state["exp_avg_sq"], ref_state["exp_avg_sq"], rtol=1e-5, atol=1e-9
            )


def test_bag_ids_keep_only_real_ids_in_sample_order():
    cols = torch.tensor([[3, -1, -1], [-1, -1, -1], [1, 2, 0]])
    ids, bags = bag_ids(cols, TableConfig("t", 5, 2, 3, jagged=True))
    assert ids.tolist() == [3, 1, 2, 0] and bags.tolist() == [0, 2, 2, 2]


def test_padding_is_an_id_only_for_jagged_tables():
    coll = EmbeddingCollection(TABLES, SparseSGD(0.1))
    ids = jagged_ids(torch.Generator().manual_seed(1))
    ids[3, 0] = PAD_ID  # the user table is not jagged: -1 is a bad id there
    with pytest.raises(IdOutOfRangeError, match=r"feature 0 \(user\): id -1 at sample 3"):
        coll(ids)
    ids = jagged_ids(torch.Generator().manual_seed(1))
    ids[2, 1] = -2  # below the padding id
    with pytest.raises(IdOutOfRangeError, match=r"id -2 .*\(valid ids: 0\.\.11, or -1 for no id\)"):
        coll(ids)
