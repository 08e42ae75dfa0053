"""A user's model class by `model._target_` trains through the CLI on a table dataset
(features named as the dataset's spec names them, regression) with the same losses on one
process and on 2 ranks (row-wise tables, gloo); a built-in model class with host-resident
tables (each collection prefetching its own features, caches warm-started from the data's
counts) trains as with every table on the device."""

from __future__ import annotations

import json

import pytest

from hybridrec.data.spec import parse_spec
from hybridrec.data.tabular import preprocess_table
from hybridrec.sparse.host import HostCachedEmbedding
from hybridrec.train.trainer import Trainer
from tests.cli import run_cli
from tests.configs import make_config
from tests.data.tables import movies, spec_dict, write_parquet
from tests.distributed.harness import spawn_jobs

pytestmark = pytest.mark.slow


def test_a_target_model_trains_equally_on_1_and_2_ranks(tmp_path):
    spec = spec_dict(label={"column": "rating", "task": "regression"})
    src = write_parquet(tmp_path / "movies.parquet", movies(80))
    preprocess_table(parse_spec(spec), [src], tmp_path / "bin", block_rows=8)
    common = (
        "data=table",
        f"data.path={tmp_path / 'bin'}",
        "model._target_=tests.models.user_model.Ratings",
        "+model.args.dim=4",
        "train.steps=4",
        "train.batch_size=8",
        "train.log_every=1",
        "eval.batch_size=8",
        "eval.batches=null",
        "optim.dense.name=sgd",
        "optim.sparse.name=rowwise_adagrad",
        "device=cpu",
    )
    runs = {}
    for name, extra in (
        ("one", ()),
        ("two", ("launcher.nproc_per_node=2", "sharding=row_wise")),
    ):
        run = tmp_path / name
        out = run_cli(*common, *extra, f"hydra.run.dir={run}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    one, two = runs["one"], runs["two"]
    assert [r["step"] for r in one if r["split"] == "train"] == [1, 2, 3, 4]
    for key in ("loss", "rmse"):
        a = [r[key] for r in one if key in r]
        b = [r[key] for r in two if key in r]
        assert len(a) == len(b) > 0 and a == pytest.approx(b, rel=1e-5, abs=1e-6), key


def _host_and_device(env):
    common = (
        "device=cpu",
        "model.arch=two_tower",
        "+model.args.user_features=[cat_0,cat_1]",
        "+model.args.item_features=[cat_2,cat_3,cat_4,cat_5]",
        "optim.sparse.name=rowwise_adagrad",
        "train.steps=12",
        "train.log_every=4",
        "train.batch_size=64",
        "eval.every=0",
        "eval.batches=2",
    )
    ref = Trainer(make_config(*common), env).fit()
    trainer = Trainer(make_config(*common, "sharding=host", "sharding.cache_fraction=0.02"), env)
    got = trainer.fit()
    hosts = sum(isinstance(m, HostCachedEmbedding) for m in trainer.model.modules())
    return ref, got, hosts, trainer.warm_start_caches()


def test_a_model_class_with_host_tables_trains_as_on_the_device():
    [(ref, got, hosts, warm_rows)] = spawn_jobs(1, [("fit", _host_and_device, ())])["fit"]
    assert hosts >= 4 and warm_rows > 0  # every collection's tables behind caches, warmed
    assert got["train"]["loss"] == pytest.approx(ref["train"]["loss"], rel=1e-5)
    assert got["eval"]["auc"] == pytest.approx(ref["eval"]["auc"], abs=1e-6)
