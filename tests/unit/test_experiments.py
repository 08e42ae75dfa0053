"""Experiment presets (`experiment=<name>`, conf/experiment/): each composes and validates,
sets what its comment says, sizes its run for the machine it names (checked with the
planner's numbers, nothing allocated), yields to command-line overrides, and trains when
scaled down to this CPU."""

from __future__ import annotations

import json

import pytest

from hybridrec.builder import make_plan
from hybridrec.config import CONF_DIR, GROUPS, check_override_keys
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
    assert EXPERIMENTS == [
        "dlrm_1tb_one_gpu",
        "kaggle_host_cache",
        "mf_movielens",
        "mlperf_dcnv2",
        "mlperf_dlrm_1tb",
        "movielens",
        "retrieval_movielens",
        "sasrec_games",
    ]
    assert "experiment" in GROUPS
    check_override_keys(["experiment=dlrm_1tb_one_gpu"])  # not an "unknown config key"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_preset_composes_and_validates(name, tmp_path):
    dataset = []
    if name in ("mlperf_dlrm_1tb", "mlperf_dcnv2"):
        dataset = ["data.path=/data/criteo/bin"]
    elif name == "movielens":  # data=table: the model comes from a preprocessed table
        from hybridrec.data.spec import parse_spec
        from hybridrec.data.tabular import preprocess_table
        from tests.data.tables import SPEC, movies, write_parquet

        src = write_parquet(tmp_path / "movies.parquet", movies())
        preprocess_table(parse_spec(SPEC), [src], tmp_path / "bin", block_rows=8)
        dataset = [f"data.path={tmp_path / 'bin'}"]
    elif name in ("mf_movielens", "retrieval_movielens"):  # the examples' own specs
        import pyarrow as pa
        import pyarrow.parquet as pq

        from hybridrec.data.spec import load_spec
        from hybridrec.data.tabular import preprocess_table

        example = "mf" if name == "mf_movielens" else "retrieval"
        spec = CONF_DIR.parent / "examples" / example / "spec.yaml"
        n = 12
        table = {"user_id": [1 + i % 3 for i in range(n)], "movie_id": list(range(1, n + 1))}
        table |= {"rating": [float(1 + i % 5) for i in range(n)], "label": [1.0] * n}
        table["split"] = ["train"] * 8 + ["val"] * 2 + ["test"] * 2
        if example == "retrieval":  # prepare.py's history: the movies before, latest first
            table["history"] = [list(range(i, 0, -1))[:3] for i in range(n)]
        pq.write_table(pa.table(table), tmp_path / "t.parquet")
        preprocess_table(load_spec(spec), [tmp_path / "t.parquet"], tmp_path / "bin")
        dataset = [f"data.path={tmp_path / 'bin'}"]
    elif name == "sasrec_games":  # data=sequences: the item table comes from the file
        from tests.sequence.files import write_user_item

        dataset = [f"data.path={write_user_item(tmp_path / 'seq.txt')}"]
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


def test_mlperf_dcnv2_preset_is_the_reference_recipe():
    """mlcommons/training recommendation_v2 (torchrec DLRM_DCN) at its batch-55296 convergence
    point: Adagrad everywhere (lr 0.004, eps 1e-8), no schedule, multi-hot bags."""
    cfg = make_config("experiment=mlperf_dcnv2", "data.path=/data/criteo/bin")
    m = cfg.model
    assert (m.name, m.arch, cfg.data.name, cfg.sharding.type) == (
        "dcnv2_1tb",
        "dcnv2",
        "criteo",
        "auto",
    )
    assert (m.embedding_dim, m.dcn_layers, m.dcn_rank) == (128, 3, 512)
    assert (list(m.bottom_mlp), list(m.top_mlp)) == ([512, 256, 128], [1024, 1024, 512, 256, 1])
    sizes = "3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1"  # --multi_hot_sizes
    assert m.hotness_list() == [int(h) for h in sizes.split(",")]
    assert cfg.data.multi_hot == "synthetic"
    for opt in (cfg.optim.dense, cfg.optim.sparse):
        assert (opt.name, opt.lr, opt.eps) == ("adagrad", 0.004, 1e-8)
    assert cfg.optim.dense.weight_decay == 0.0
    s = cfg.optim.schedule
    assert (s.warmup_steps, s.decay_start, s.decay_steps) == (0, 0, 0)
    assert (cfg.train.batch_size, cfg.train.epochs, cfg.eval.target_auc) == (55296, 1, 0.80275)
    assert cfg.eval.batches is None and cfg.eval.every == 4_195_197_692 // (55296 * 20)
    with pytest.raises(ValueError, match="data.path must name a directory"):
        make_config("experiment=mlperf_dcnv2")


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
    assert any(r["split"] == "val" for r in rows)


@pytest.mark.slow
def test_mlperf_dcnv2_preset_scaled_down_trains_on_the_cpu(tmp_path, sample_tsv):
    """The preset's optimizers, DCNv2 and on-the-fly multi-hot bags, on the 200-row Criteo
    sample with a small model: element-wise Adagrad state next to every table, dense Adagrad."""
    import torch

    from hybridrec.distributed import init_distributed
    from hybridrec.train.trainer import Trainer

    cfg = make_config(
        "experiment=mlperf_dcnv2",
        "data=criteo_sample",
        "model=criteo_sample",
        "model.arch=dcnv2",
        "model.hotness=2",
        "model.embedding_dim=8",
        "model.dcn_rank=8",
        "model.bottom_mlp=[16,8]",
        "model.top_mlp=[16,1]",
        "train.epochs=null",
        "train.steps=10",
        "train.batch_size=32",
        "train.log_every=5",
        "eval.batch_size=10",
        "eval.every=5",
        "device=cpu",
        "sharding=none",  # one process, no process group
    )
    trainer = Trainer(cfg, init_distributed("cpu"), tmp_path)
    result = trainer.fit()
    assert isinstance(trainer.dense_opt, torch.optim.Adagrad)
    d = trainer.dense_opt.defaults  # the settings MLPerf's compliance checker requires
    assert (d["lr"], d["eps"], d["lr_decay"], d["weight_decay"]) == (0.004, 1e-8, 0, 0)
    assert d["initial_accumulator_value"] == 0
    for spec, weight, state in trainer.embeddings[0].shard_views():
        assert state["sum"].shape == weight.shape, spec.table  # one sum per element
    touched = sum(
        int((s["sum"] > 0).any(1).sum()) for _, _, s in trainer.embeddings[0].shard_views()
    )
    assert touched > 0 and 0 < result["eval"]["auc"] < 1
