"""Evaluation covers a file split exactly: every row once, whatever the eval batch size and
world size. The last batch wraps around to fill up, and the wrapped samples are masked out,
so the metrics equal those of one batch holding the whole val split (20 rows here). An eval
batch the world size does not divide is padded per rank and masked the same way; a host cache
sized for the training batch evaluates a larger eval batch in chunks."""

from __future__ import annotations

import pytest
import torch

from hybridrec.distributed import DistEnv, init_distributed
from hybridrec.train.trainer import Trainer
from tests.data.tables import criteo_cfg
from tests.distributed.harness import spawn, spawn_jobs


def _evaluate(  # noqa: ANN001
    env: DistEnv, path: str, sharding: str, loader: str, eval_batch: int, batches, train_batch=24
):
    torch.set_num_threads(1)
    cfg = criteo_cfg(path, sharding, loader, env.world_size)
    cfg.eval.batch_size, cfg.eval.batches = eval_batch, batches
    # a host cache holds two training batches' ids per table (at train_batch=2 it holds 4)
    cfg.sharding.cache_fraction, cfg.train.batch_size = 0.001, train_batch
    trainer = Trainer(cfg, env)
    for step in range(2):  # a trained model, not the initial one
        trainer.train_step(trainer.train_batch(step))
    return trainer.evaluate()


def _same(got: dict, want: dict) -> None:
    assert got["eval_samples"] == want["eval_samples"]
    for k in ("auc", "logloss", "accuracy"):
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k


# the module's tests share one module-scoped fixture: one test worker runs them all, so it
# is built once (scripts/test.sh: pytest-xdist --dist loadgroup)
pytestmark = pytest.mark.xdist_group("data/test_eval_exact")


@pytest.fixture(scope="module")
def three_ranks(sample_dataset) -> dict:
    """Both tests' 3-rank evaluations, in one spawn."""
    path = str(sample_dataset)
    jobs = [
        ("broadcast, batch 6", _evaluate, (path, "table_wise", "broadcast", 6, None)),
        ("uneven", _uneven, (path,)),
    ]
    return spawn_jobs(3, jobs)


@pytest.mark.slow
def test_whole_split_once_for_any_batch_size_and_world_size(sample_dataset, three_ranks):
    path = str(sample_dataset)
    one = init_distributed("cpu")
    whole = _evaluate(one, path, "none", "per_rank", 20, None)  # one batch: the whole split
    assert whole["eval_samples"] == 20
    for eval_batch in (6, 8, 64):  # 3 full + 2 real of 6; 2 + 4 of 8; 20 of 64 (wraps 3x)
        _same(_evaluate(one, path, "none", "per_rank", eval_batch, None), whole)
    first_two = _evaluate(one, path, "none", "per_rank", 6, 2)
    assert first_two["eval_samples"] == 12
    for got in three_ranks["broadcast, batch 6"]:
        _same(got, whole)
    for got in spawn(2, _evaluate, path, "row_wise", "per_rank", 8, None):
        _same(got, whole)


def _uneven(env: DistEnv, path: str):  # noqa: ANN202
    """The whole split per rank-slice loader, the first two batches by broadcast."""
    return (
        _evaluate(env, path, "row_wise", "per_rank", 8, None),
        _evaluate(env, path, "table_wise", "broadcast", 8, 2),
    )


@pytest.mark.slow
def test_eval_batch_need_not_split_over_ranks(sample_dataset, three_ranks):
    """8 samples per eval batch on 3 ranks: slices of 3, 3 and 2 (+1 padding)."""
    path = str(sample_dataset)
    one = init_distributed("cpu")
    whole = _evaluate(one, path, "none", "per_rank", 20, None)
    first_two = _evaluate(one, path, "none", "per_rank", 8, 2)
    assert first_two["eval_samples"] == 16
    for got_whole, got_two in three_ranks["uneven"]:
        _same(got_whole, whole)
        _same(got_two, first_two)


def test_host_cache_sized_for_training_evaluates_a_larger_batch(sample_dataset):
    """A cache that holds two training batches' rows (2 samples), not an eval batch's (20)."""
    path = str(sample_dataset)
    one = init_distributed("cpu")
    whole = _evaluate(one, path, "none", "per_rank", 20, None, 2)
    [got] = spawn(1, _evaluate, path, "host", "per_rank", 20, None, 2)
    _same(got, whole)
