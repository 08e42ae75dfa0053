"""model.task=regression: the mean squared error of the raw output against float labels.

- Sharded training equals the single-process reference (the equivalence principle of
  tests/distributed/test_equivalence.py, same tolerance) on 1 and 3 gloo ranks, on the
  preprocessed Criteo sample: its 0/1 labels are float labels like any other.
- RMSE and MAE are exact over an eval split that neither the eval batch nor the world size
  divides (20 rows, batches of 8, 3 ranks: a wrapped last batch and padded rank slices),
  against numpy over the 20 rows; the labels come from an in-memory source of real floats.
- A run logs the regression metrics (no AUC), stops at eval.target_rmse, and its export
  carries the task: `predict` returns the raw output, not a probability.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridrec.data import build_source
from hybridrec.data.loader import BatchSource, SliceLoader
from hybridrec.distributed import DistEnv, init_distributed
from hybridrec.model import DLRM, InferenceModel, load_export
from hybridrec.train.evaluator import evaluate
from hybridrec.train.export_cli import main as export_main
from hybridrec.train.trainer import Trainer
from hybridrec.types import Batch
from tests.configs import make_config
from tests.distributed.harness import spawn
from tests.equivalence import STEPS, compare, reference, train_and_collect

MODES = {"table_wise": "rowwise_adagrad", "row_wise": "adam", "column_wise": "sgd"}
EVAL_ROWS, EVAL_BATCH = 20, 8


def _cfg(path: str, sharding: str, sparse: str, world: int, *extra: str):
    overrides = [
        "model.task=regression",
        "data=criteo",
        f"data.path={path}",
        "model=criteo_sample",
        f"sharding={sharding}",
        f"optim.sparse.name={sparse}",
        "optim.dense.name=sgd",
        "optim.dense.lr=0.1",
        "train.batch_size=24",
        "eval.batch_size=6",
        "device=cpu",
        "seed=3",
        *extra,
    ]
    return make_config(*overrides, world_size=world)


class FloatLabels(BatchSource):
    """An in-memory source: EVAL_ROWS samples with real-valued labels in its eval split (a
    last batch wraps around to the start, as file sources do)."""

    def __init__(self, model: InferenceModel, rows: int = EVAL_ROWS) -> None:
        g = torch.Generator().manual_seed(11)
        self.rows = rows
        self.dense = torch.randn(rows, model.cfg.num_dense_features, generator=g)
        cols = [torch.randint(0, t.num_rows, (rows, t.hotness), generator=g) for t in model.tables]
        self.ids = torch.cat(cols, dim=1)
        self.labels = torch.randn(rows, generator=g) * 2 + 3

    def steps_per_epoch(self, batch_size: int, split: str = "train") -> int:
        return -(-self.rows // batch_size)

    def batch(self, step: int, batch_size: int, split: str = "train") -> Batch:
        idx = (step * batch_size + torch.arange(batch_size)) % self.rows
        return Batch(self.dense[idx], self.ids[idx], self.labels[idx])


def _model(path: str) -> InferenceModel:
    torch.manual_seed(5)
    return InferenceModel(_cfg(path, "none", "sgd", 1).model, DLRM)


def _eval_metrics(env: DistEnv, path: str) -> dict[str, float]:
    """The regression metrics of a fixed model over FloatLabels' eval split, on this rank."""
    model = _model(path)
    source = FloatLabels(model)
    loader = SliceLoader(source, env.rank, env.world_size, EVAL_BATCH, "eval")
    autocast = torch.autocast("cpu", enabled=False)
    return evaluate(
        model, loader, env, EVAL_BATCH, None, EVAL_ROWS, autocast, lambda: None, "regression"
    )


def _run(env: DistEnv, path: str) -> dict:
    """Both checks of one world size, in one spawn: training per mode, then the metrics."""
    world = env.world_size
    trained = {m: train_and_collect(env, _cfg(path, m, o, world)) for m, o in MODES.items()}
    return {"trained": trained, "metrics": _eval_metrics(env, path)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_regression_matches_reference_and_its_metrics_are_exact(sample_dataset, world):
    path = str(sample_dataset)
    results = spawn(world, _run, path)
    for mode, sparse in MODES.items():
        ref_cfg = _cfg(path, "none", sparse, 1)
        ref = reference(ref_cfg)
        # the loss is the mean squared error of the raw output (not a cross-entropy)
        batch0 = build_source(ref_cfg).batch(0, ref_cfg.train.batch_size)
        mse = torch.mean((ref["logits"] - batch0.labels) ** 2)
        assert ref["losses"][0] == pytest.approx(float(mse), rel=1e-6)
        assert len(ref["losses"]) == STEPS and ref["losses"][-1] != ref["losses"][0]
        per_rank = [res["trained"][mode] for res in results]
        compare(ref, per_rank, _cfg(path, mode, sparse, world), f"W={world} regression {mode}")

    model = _model(path)
    source = FloatLabels(model)
    with torch.no_grad():
        out = model(source.dense, source.ids).double().numpy()
    err = out - source.labels.double().numpy()
    want = {"loss": np.mean(err**2), "rmse": np.sqrt(np.mean(err**2)), "mae": np.mean(abs(err))}
    for got in (res["metrics"] for res in results):
        assert set(got) == {"loss", "rmse", "mae", "eval_samples"}
        assert got["eval_samples"] == EVAL_ROWS
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-6), k


def test_a_regression_run_logs_its_metrics_stops_at_its_target_and_exports_raw_outputs(
    sample_dataset, tmp_path, caplog
):
    overrides = ["eval.target_rmse=100", "eval.every=2", "eval.batches=null", "train.steps=6"]
    cfg = _cfg(str(sample_dataset), "none", "adam", 1, *overrides)
    cfg.checkpoint.dir = str(tmp_path / "ck")
    trainer = Trainer(cfg, init_distributed("cpu"), tmp_path / "run")
    with caplog.at_level("INFO", logger="hybridrec"):
        result = trainer.fit()
    assert trainer.step == 2  # any RMSE is <= 100: the first evaluation stops the run
    assert "reached eval.target_rmse=100" in caplog.text
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    evals = [r for r in rows if r["split"] == "val"]
    assert len(evals) == 1 and evals[0]["eval_samples"] == 20
    assert {"loss", "rmse", "mae"} <= set(evals[0]) and "auc" not in evals[0]
    assert evals[0]["rmse"] == pytest.approx(evals[0]["loss"] ** 0.5)
    assert result["eval"]["rmse"] == evals[0]["rmse"]
    eval_lines = [r.getMessage() for r in caplog.records if "eval @ step" in r.getMessage()]
    assert len(eval_lines) == 1 and " rmse " in eval_lines[0] and "auc" not in eval_lines[0]

    out = tmp_path / "model.pt"
    assert export_main([str(tmp_path / "ck"), str(out)]) == 0
    model = load_export(out)
    assert model.cfg.task == "regression" and model.cfg == cfg.model
    batch = trainer.train_batch(3)
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.score(batch.dense, batch.ids)
    torch.testing.assert_close(model.predict(batch.dense, batch.ids), want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(model.predict(batch.dense, batch.ids), torch.sigmoid(want))
