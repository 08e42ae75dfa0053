"""Training with host-resident tables: same results as all-on-device, logged cache metrics,
warm start from the dataset's id counts, and clear errors for memory that is not there."""

from __future__ import annotations

import json
import os

import pytest

from hybridrec.builder import build
from hybridrec.data.source import SAMPLE_ENV
from hybridrec.distributed import DistEnv
from hybridrec.sparse.host import HostMemoryError
from hybridrec.train.trainer import Trainer
from tests.cli import run_cli
from tests.configs import make_config
from tests.distributed.harness import spawn_jobs


def _cfg(*overrides: str):
    return make_config("device=cpu", *overrides)


def _fit_both(env, tmp_path):
    """sharding=none and sharding=host (one rank, 1% caches) on the same data."""
    common = ["train.steps=30", "train.log_every=10", "eval.every=15", "eval.batches=2"]
    ref = Trainer(_cfg(*common), env, tmp_path / "ref").fit()
    trainer = Trainer(
        _cfg(*common, "sharding=host", "sharding.cache_fraction=0.01"), env, tmp_path / "host"
    )
    got = trainer.fit()
    host = [g.host is not None for g in trainer.embeddings[0].groups.values()]
    return ref, got, any(host)


# the module's tests share one module-scoped fixture: one test worker runs them all, so it
# is built once (scripts/test.sh: pytest-xdist --dist loadgroup)
pytestmark = pytest.mark.xdist_group("train/test_host_training")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    """The fit comparison and the warm start, each in its own directory: one 1-rank spawn."""
    fit_dir, warm_dir = tmp_path_factory.mktemp("fit"), tmp_path_factory.mktemp("warm")
    jobs = [("fit", _fit_both, (fit_dir,))]
    if os.environ.get(SAMPLE_ENV):  # the warm start reads the Criteo sample's counts
        jobs.append(("warm", _warm, (warm_dir,)))
    return {"fit_dir": fit_dir, **spawn_jobs(1, jobs)}


def test_host_training_equals_device_training_and_logs_cache_metrics(one_rank):
    [(ref, got, has_host)] = one_rank["fit"]
    tmp_path = one_rank["fit_dir"]
    assert has_host
    assert got["eval"]["auc"] == pytest.approx(ref["eval"]["auc"], abs=1e-6)
    assert got["train"]["loss"] == pytest.approx(ref["train"]["loss"], rel=1e-5)
    rows = [json.loads(x) for x in (tmp_path / "host" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert len(train) == 3
    for r in train:
        assert 0.0 <= r["cache/hit_rate"] <= 1.0
        assert r["cache/rows_in_per_step"] > 0  # 1% caches: rows keep moving
        assert r["cache/copy_gb_s"] > 0 and r["time_ms/host_wait"] >= 0


def test_cli_prints_the_host_placement(tmp_path):
    out = run_cli(
        "sharding=host",
        "train.steps=4",
        "train.log_every=2",
        "eval.batches=1",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "@host(cache" in out.stderr
    # synthetic data knows its id popularity: the caches start with the hottest rows
    assert "host caches warm-started with" in out.stderr
    assert "host caches: expected hit rate 0." in out.stderr
    # each progress line says how the cache does
    assert "step 2/4  loss" in out.stderr and "cache hit " in out.stderr
    assert "rows in /" in out.stderr and "waited" in out.stderr


def test_not_enough_host_memory_is_refused_before_allocating():
    cfg = _cfg("sharding=host", "sharding.host_gb=0.0001")
    with pytest.raises(HostMemoryError) as info:
        build(cfg, DistEnv())  # one process: no group needed
    msg = str(info.value)
    assert "rank 0's host-resident tables (cat_0, cat_1" in msg
    assert "sharding.host_gb is 0.00 GiB (107,374 bytes)" in msg


def _warm(env, tmp_path):
    cfg = _cfg(
        "data=criteo_sample",
        "model=criteo_sample",
        "sharding=host",
        "train.batch_size=32",
        f"data.cache_dir={tmp_path / 'cache'}",
    )
    trainer = Trainer(cfg, env, tmp_path / "run")
    trainer.warm_start_caches()
    emb = trainer.embeddings[0]
    # table 2's hottest id: which group and row it is in, and whether it is cached
    hottest = int(trainer.source.id_counts(2).argmax())
    key, pos = emb.layout.locate(2)
    group = emb.groups[key].store
    cached = int(group.slot_of[group.offsets_list[pos] + hottest]) >= 0
    fractions = [g.cached_fraction() for g in emb.host_groups()]
    return fractions, cached


def test_caches_warm_start_from_the_dataset_counts(one_rank, sample_tsv):
    [(fractions, hottest_cached)] = one_rank["warm"]
    assert fractions and all(f > 0 for f in fractions)
    assert hottest_cached
