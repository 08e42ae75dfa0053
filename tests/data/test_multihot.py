"""data.multi_hot=synthetic: one-hot Criteo ids expanded into bags of model.hotness ids by a
fixed rule, the same for every reader, loader and rank (hybridrec.data.multihot)."""

from __future__ import annotations

import pytest
import torch

from hybridrec.data import open_dataset
from hybridrec.data.multihot import SyntheticMultiHot
from hybridrec.data.source import BinarySource
from hybridrec.distributed import DistEnv, init_distributed
from hybridrec.train.trainer import Trainer
from tests.data.tables import criteo_cfg
from tests.distributed.harness import spawn


def test_bags_start_with_the_id_and_add_fixed_uniform_companions():
    m = SyntheticMultiHot([1000, 7, 40_000_000], [3, 1, 5])
    ids = torch.tensor([[5, 3, 123456], [5, 6, 0], [999, 3, 39_999_999]])
    out = m(ids)
    assert out.shape == (3, 9) and out.dtype == torch.int64
    assert torch.equal(out[:, [0, 3, 4]], ids)  # each bag starts with its one-hot id
    assert torch.equal(out[0, 1:3], out[1, 1:3])  # same id, same companions
    assert not torch.equal(out[0, 5:], out[1, 5:])
    for lo, hi, rows in ((1, 3, 1000), (5, 9, 40_000_000)):
        assert (out[:, lo:hi] >= 0).all() and (out[:, lo:hi] < rows).all()
    torch.testing.assert_close(m(ids), out, rtol=0, atol=0)  # a pure function
    wide = m(
        torch.stack(
            [torch.arange(50_000), torch.zeros(50_000, dtype=torch.long), torch.arange(50_000)], 1
        )
    )
    extra = wide[:, 5:].float() / 40_000_000  # companions spread over the whole table
    assert abs(float(extra.mean()) - 0.5) < 0.01 and float(extra.std()) > 0.28
    with pytest.raises(ValueError, match=r"one-hot ids must be \[batch, 3\]"):
        m(torch.zeros(2, 4, dtype=torch.long))


def test_source_expands_what_the_reader_reads(sample_dataset):
    ds = open_dataset(sample_dataset)
    rows = ds.manifest.cardinalities
    hot = [2 if t % 3 == 0 else 1 for t in range(len(rows))]
    plain = BinarySource(ds, seed=1)
    multi = BinarySource(ds, seed=1, multi_hot=SyntheticMultiHot(rows, hot))
    a, b = plain.batch(3, 16), multi.batch(3, 16)
    assert b.ids.shape == (16, sum(hot))
    starts = torch.tensor([0, *torch.tensor(hot).cumsum(0)[:-1].tolist()])
    assert torch.equal(b.ids[:, starts], a.ids) and torch.equal(b.dense, a.dense)
    part = multi.slice_batch(3, 16, "train", 4, 12)  # a rank's slice: the same rows
    assert torch.equal(part.ids, b.ids[4:12])


def _losses(env: DistEnv, path: str, sharding: str):
    torch.set_num_threads(1)
    cfg = criteo_cfg(path, sharding, "broadcast", env.world_size)
    cfg.model.hotness = [3 if t in (0, 9, 20) else 1 for t in range(26)]
    cfg.data.multi_hot = "synthetic"
    trainer = Trainer(cfg, env)
    it = trainer.loader("train", 0)
    losses = [trainer.global_mean(trainer.train_step(next(it))) for _ in range(5)]
    it.close()
    return losses


@pytest.mark.slow
def test_multi_hot_criteo_trains_the_same_on_two_ranks(sample_dataset):
    ref = _losses(init_distributed("cpu"), str(sample_dataset), "none")
    for got in spawn(2, _losses, str(sample_dataset), "row_wise"):
        assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
