"""hybridrec.model.load_export: a trained model from a hybridrec-export file as a plain
PyTorch module that scores like the trainer's own model."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from hybridrec.config import ModelConfig
from hybridrec.distributed import init_distributed
from hybridrec.model import DLRM, InferenceModel, PredictInputError, load_export
from hybridrec.train.checkpoint import export_checkpoint, list_checkpoints
from hybridrec.train.export_cli import main as export_main
from hybridrec.train.trainer import Trainer
from tests.equivalence import jagged_cfg, make_cfg


@pytest.mark.parametrize("pooling", ["sum", "mean", "jagged"])
def test_exported_model_scores_like_the_trainer(tmp_path, pooling, capsys):
    # jagged: list features padded with -1 (sum and mean), tables of widths 4 and 8 (dcnv2)
    if pooling == "jagged":
        cfg = jagged_cfg("none", "adam", 1)
    else:
        cfg = make_cfg("none", "adam", 1, pooling)
    cfg.checkpoint.dir, cfg.train.steps, cfg.eval.batches = str(tmp_path / "ck"), 4, 1
    trainer = Trainer(cfg, init_distributed("cpu"))
    trainer.fit()
    out = tmp_path / "model.pt"
    assert export_main([str(tmp_path / "ck"), str(out)]) == 0
    assert "hybridrec.model.load_export" in capsys.readouterr().out
    model = load_export(out)
    assert isinstance(model, InferenceModel) and model.cfg == cfg.model
    batch = trainer.train_batch(9)
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.score(batch.dense, batch.ids)
    torch.testing.assert_close(model(batch.dense, batch.ids), want, rtol=1e-5, atol=1e-6)
    p = model.predict(batch.dense, batch.ids)
    assert p.shape == (batch.size,) and ((p > 0) & (p < 1)).all()


def test_old_exports_need_the_config_and_shapes_are_checked(tmp_path):
    cfg = make_cfg("none", "sgd", 1)
    cfg.checkpoint.dir, cfg.train.steps, cfg.eval.batches = str(tmp_path / "ck"), 2, 1
    Trainer(cfg, init_distributed("cpu")).fit()
    out = tmp_path / "model.pt"
    export_checkpoint(list_checkpoints(tmp_path / "ck")[-1], out)
    state = torch.load(out, weights_only=True)
    del state["model_config"]  # as written before exports carried the config
    torch.save(state, out)
    with pytest.raises(ValueError, match="carries no model config .* load_export\\(path, cfg"):
        load_export(out)
    assert load_export(out, cfg.model).cfg == cfg.model
    other = ModelConfig(**{**dataclasses.asdict(cfg.model), "bottom_mlp": [32, 8]})
    with pytest.raises(
        ValueError, match=r"dense.bottom.0.weight: file \[16, 13\], model \[32, 13\]"
    ):
        load_export(out, other)
    with pytest.raises(FileNotFoundError, match="no such exported model"):
        load_export(tmp_path / "nope.pt")


def test_inference_model_exports_with_torch_export_and_tracing():
    """What the module docstring promises: an ordinary module for serving toolchains."""
    model = InferenceModel(make_cfg("none", "sgd", 1).model, DLRM).eval()
    dense, ids = torch.randn(8, 13), torch.randint(0, 3, (8, 8))
    want = model(dense, ids)
    exported = torch.export.export(model, (dense, ids))
    torch.testing.assert_close(exported.module()(dense, ids), want)
    torch.testing.assert_close(torch.jit.trace(model, (dense, ids))(dense, ids), want)


@pytest.fixture()
def exported(tmp_path):
    """load_export of a freshly initialised model (the checks do not need trained weights)."""
    cfg = make_cfg("none", "sgd", 1).model
    state = {k: v.detach() for k, v in InferenceModel(cfg, DLRM).expected().items()}
    state["model_config"] = json.dumps(dataclasses.asdict(cfg))
    torch.save(state, tmp_path / "model.pt")
    return load_export(tmp_path / "model.pt")


BAD_PREDICT = {
    "dense 1-d": (
        lambda d, i: (d[0], i),
        r"^dense must be a float tensor \[batch, 13\] \(model.num_dense_features\), "
        r"got torch.float32 \[13\]$",
    ),
    "dense width": (
        lambda d, i: (d[:, :12], i),
        r"^dense must be a float tensor \[batch, 13\] .* got torch.float32 \[8, 12\]$",
    ),
    "dense ints": (
        lambda d, i: (d.long(), i),
        r"^dense must be a float tensor .* got torch.int64 \[8, 13\]$",
    ),
    "ids width": (
        lambda d, i: (d, i[:, :7]),
        r"^ids must be an int64 \(or int32\) tensor \[batch, 8\] \(one column per id of the 5 tables\), "
        r"got torch.int64 \[8, 7\]$",
    ),
    "ids float": (lambda d, i: (d, i.float()), r"^ids must be an int64 .* got torch.float32"),
    "ids bool": (lambda d, i: (d, i > 0), r"^ids must be an int64 .* got torch.bool \[8, 8\]$"),
    "rows": (lambda d, i: (d[:5], i), r"^dense has 5 rows but ids has 8; one row per sample$"),
    "nan": (
        lambda d, i: (d.index_put((torch.tensor(3), torch.tensor(4)), torch.tensor(math.nan)), i),
        r"^dense feature 4: nan at row 3 is not finite \(NaN or inf\); give every dense",
    ),
    "inf": (
        lambda d, i: (d.index_put((torch.tensor(6), torch.tensor(0)), torch.tensor(-math.inf)), i),
        r"^dense feature 0: -inf at row 6 is not finite",
    ),
    "id too large": (
        lambda d, i: (d, i.index_put((torch.tensor(5), torch.tensor(3)), torch.tensor(700))),
        r"^table 'cat_2' \(feature 2\): id 700 at row 5 is outside its 700 rows \(valid ids: 0..699\)$",
    ),
    "id negative": (
        lambda d, i: (d, i.index_put((torch.tensor(1), torch.tensor(7)), torch.tensor(-1))),
        r"^table 'cat_4' \(feature 4\): id -1 at row 1 is outside its 20000 rows",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_PREDICT))
def test_predict_names_the_bad_input(exported, case):
    """Bad inputs to predict: one line naming the feature or table, the value and its row
    (not a bare index error, nor NaN probabilities)."""
    make, message = BAD_PREDICT[case]
    dense, ids = torch.randn(8, 13), torch.randint(0, 3, (8, 8))
    assert exported.predict(dense, ids).isfinite().all()
    with pytest.raises(PredictInputError, match=message) as e:
        exported.predict(*make(dense, ids))
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
