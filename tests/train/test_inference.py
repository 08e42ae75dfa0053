"""hybridrec.model.load_export: a trained model from a hybridrec-export file as a plain
PyTorch module that scores like the trainer's own model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridrec.config import ModelConfig
from hybridrec.distributed import init_distributed
from hybridrec.model import InferenceDLRM, load_export
from hybridrec.train.checkpoint import export_checkpoint, list_checkpoints
from hybridrec.train.export_cli import main as export_main
from hybridrec.train.trainer import Trainer
from tests.distributed.test_equivalence import make_cfg


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_exported_model_scores_like_the_trainer(tmp_path, pooling, capsys):
    cfg = make_cfg("none", "adam", 1, pooling)
    cfg.checkpoint.dir, cfg.train.steps, cfg.eval.batches = str(tmp_path / "ck"), 4, 1
    trainer = Trainer(cfg, init_distributed("cpu"))
    trainer.fit()
    out = tmp_path / "model.pt"
    assert export_main([str(tmp_path / "ck"), str(out)]) == 0
    assert "hybridrec.model.load_export" in capsys.readouterr().out
    model = load_export(out)
    assert isinstance(model, InferenceDLRM) and model.cfg == cfg.model
    batch = trainer.train_batch(9)
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(batch.dense, batch.ids)
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
    model = InferenceDLRM(make_cfg("none", "sgd", 1).model).eval()
    dense, ids = torch.randn(8, 13), torch.randint(0, 3, (8, 8))
    want = model(dense, ids)
    exported = torch.export.export(model, (dense, ids))
    torch.testing.assert_close(exported.module()(dense, ids), want)
    torch.testing.assert_close(torch.jit.trace(model, (dense, ids))(dense, ids), want)
