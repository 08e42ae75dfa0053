"""Experiment presets (`experiment=<name>`, conf/experiment/): each composes and validates,
sets what its comment says, sizes its run for the machine it names (checked with the
planner's numbers, nothing allocated), yields to command-line overrides, and trains when
scaled down to this CPU."""

from __future__ import annotations

import json

import pytest

from hybridrec.config import CONF_DIR, GROUPS, check_override_keys
from hybridrec.parallelize import make_plan
from hybridrec.planner import OptimizerFootprint, host_memory, rank_memory
from tests.cli import run_cli
from tests.configs import make_config

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
GiB = 2**30


def _memory(cfg) -> tuple[float, float, bool]:
    """(planned device GiB, host GiB, every shard in host memory) on one rank."""
    plan = make_plan(cfg, 1)
    footprint = OptimizerFootprint.for_optimizer(cfg.optim.sparse.name)
    device = rank_memory(plan, cfg.model.tables(), cfg.train.batch_size, footprint, 4)[0]
    host = host_memory(plan, footprint, 4)[0]
    on_host = all(s.on_host for tp in plan.tables for s in tp.shards)
    return device.total / GiB, host / GiB, on_host


def test_presets_exist_and_are_a_group_of_the_cli():
    assert EXPERIMENTS == ["dlrm_1tb_one_gpu", "kaggle_host_cache", "mlperf_dlrm_1tb", "movielens"]
    assert "experiment" in GROUPS
    check_override_keys(["experiment=dlrm_1tb_one_gpu"])  # not an "unknown config key"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_preset_composes_and_validates(name, tmp_path):
    dataset = []
    if name == "mlperf_dlrm_1tb":
        dataset = ["data.path=/data/criteo/bin"]
    elif name == "movielens":  # data=table: the model comes from a preprocessed table
        from hybridrec.data.spec import parse_spec
        from hybridrec.data.tabular import preprocess_table
        from tests.data.tables import SPEC, movies, write_parquet

        src = write_parquet(tmp_path / "movies.parquet", movies())
        preprocess_table(parse_spec(SPEC), [src], tmp_path / "bin", block_rows=8)
        dataset = [f"data.path={tmp_path / 'bin'}"]
    cfg = make_config(f"experiment={name}", *dataset)
    assert cfg.train.batch_size > 0


def test_one_gpu_1tb_preset_fits_16_gib_of_gpu_and_the_gpu_machines_host_ram():
    cfg = make_config("experiment=dlrm_1tb_one_gpu")
    assert cfg.model.name == "dlrm_1tb" and cfg.sharding.type == "host"
    assert sum(t.num_rows for t in cfg.model.tables()) == 187_767_399  # ~96 GB of fp32 x 128
    assert cfg.device == "cuda" and cfg.train.batch_size == 65536
    device_gib, host_gib, on_host = _memory(cfg)
    assert on_host and device_gib <= 16 and cfg.sharding.hbm_gb == 16
    assert 85 < host_gib < 100  # tables + row-wise Adagrad state: "~97 GB" (90 GiB) < 125 GB


def test_kaggle_host_preset_caches_5_percent_of_rows():
    cfg = make_config("experiment=kaggle_host_cache")
    assert (cfg.model.name, cfg.sharding.type, cfg.sharding.cache_fraction) == (
        "dlrm_kaggle",
        "host",
        0.05,
    )
    device_gib, host_gib, on_host = _memory(cfg)
    assert on_host and device_gib < 4 and 15 < host_gib < 17  # "~17 GB" (16.2 GiB)


def test_mlperf_preset_is_the_reference_recipe_and_needs_a_dataset():
    cfg = make_config("experiment=mlperf_dlrm_1tb", "data.path=/data/criteo/bin")
    assert (cfg.model.name, cfg.data.name, cfg.sharding.type) == ("dlrm_1tb", "criteo", "auto")
    assert (cfg.optim.dense.name, cfg.optim.dense.lr) == ("sgd", 1.0)
    assert (cfg.optim.sparse.name, cfg.optim.sparse.lr) == ("sgd", 1.0)
    assert (cfg.train.batch_size, cfg.train.epochs, cfg.eval.target_auc) == (2048, 1, 0.8025)
    assert cfg.eval.batches is None and cfg.eval.every == 102400
    with pytest.raises(ValueError, match="data.path must name a directory"):
        make_config("experiment=mlperf_dlrm_1tb")


def test_command_line_overrides_beat_the_preset():
    cfg = make_config("experiment=kaggle_host_cache", "train.batch_size=512", "model=dlrm_tiny")
    assert cfg.train.batch_size == 512 and cfg.model.name == "dlrm_tiny"
    assert cfg.sharding.type == "host"  # the rest of the preset stays


@pytest.mark.slow
def test_one_gpu_preset_scaled_down_trains_on_the_cpu(tmp_path):
    """The preset's host-memory tables and cache, with the tiny model on this CPU."""
    run = tmp_path / "run"
    out = run_cli(
        "experiment=dlrm_1tb_one_gpu",
        "device=cpu",
        "model=dlrm_tiny",
        "train.batch_size=256",
        "eval.batch_size=256",
        "train.steps=20",
        "train.log_every=10",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "@host(cache" in out.stderr and "cache hit" in out.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [10, 20]
    assert any(r["split"] == "eval" for r in rows)
