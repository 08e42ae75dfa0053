from __future__ import annotations

import pytest
import torch

from hybridrec.data import SyntheticCriteo
from hybridrec.types import TableConfig

TABLES = [TableConfig("a", 1000, 4), TableConfig("b", 50, 4, hotness=3)]


def test_deterministic_per_step_and_split():
    d1, d2 = SyntheticCriteo(TABLES, seed=3), SyntheticCriteo(TABLES, seed=3)
    b1, b2 = d1.batch(7, 64), d2.batch(7, 64)
    assert torch.equal(b1.ids, b2.ids) and torch.equal(b1.dense, b2.dense)
    assert torch.equal(b1.labels, b2.labels)
    assert not torch.equal(d1.batch(8, 64).ids, b1.ids)
    assert not torch.equal(d1.batch(7, 64, "eval").ids, b1.ids)
    assert not torch.equal(SyntheticCriteo(TABLES, seed=4).batch(7, 64).ids, b1.ids)


def test_shapes_ranges_and_heavy_tail():
    b = SyntheticCriteo(TABLES).batch(0, 20_000)
    assert (
        b.dense.shape == (20_000, 13) and b.ids.shape == (20_000, 4) and b.labels.shape == (20_000,)
    )
    assert b.ids[:, 0].max() < 1000 and b.ids[:, 1:].max() < 50 and b.ids.min() >= 0
    counts = torch.bincount(b.ids[:, 0], minlength=1000).sort(descending=True).values
    assert counts[:10].sum() > 0.2 * 20_000  # Zipf-like: top 1% of rows get >20% of lookups
    assert 0.1 < b.labels.mean() < 0.6
    assert (b.dense >= 0).all()


@pytest.mark.parametrize("s", [1.05, 1.0, 0.8])
def test_id_counts_are_the_popularity_the_ids_are_drawn_from(s):
    """id_counts (what warm-starts host caches) matches the ids drawn, per million samples."""
    tables = [TableConfig("a", 1000, 4), TableConfig("b", 37, 4, hotness=3)]
    src = SyntheticCriteo(tables, zipf_exponent=s)
    batches = [src.batch(step, 4096).ids for step in range(100)]
    for t, table in enumerate(tables):
        want = torch.from_numpy(src.id_counts(t))
        ids = torch.cat([b[:, src.offsets[t] : src.offsets[t + 1]].reshape(-1) for b in batches])
        seen = torch.bincount(ids, minlength=table.num_rows).double() * 1e6 / (100 * 4096)
        assert want.shape == (table.num_rows,)
        torch.testing.assert_close(
            want.sum(), torch.tensor(1e6 * table.hotness, dtype=torch.float64)
        )
        hot = torch.topk(want, 10).indices
        torch.testing.assert_close(seen[hot], want[hot], rtol=0.05, atol=0)
        assert set(torch.topk(seen, 10).indices.tolist()) == set(hot.tolist())
