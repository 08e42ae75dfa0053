"""Checkpoints and exports written before the one-build-path change still load and give the
same results (tests/fixtures/format_v1: made by its make.py at commit df62e06): eval.only on
the checkpoint reports the metrics it reported then, training resumes from it, and the export
predicts what it predicted then. One DLRM, one DCNv2 with two widths, one two-tower model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hybridrec.distributed.env import DistEnv
from hybridrec.model import load_export
from hybridrec.train.trainer import Trainer
from tests.configs import make_config
from tests.fixtures.format_v1.make import COMMON, MODELS, inputs

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "format_v1"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_old_checkpoint_evaluates_and_resumes(tmp_path, name, caplog):
    ck = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / name / "ckpt", ck)
    cfg = make_config(*COMMON, *MODELS[name], f"checkpoint.dir={ck}", "train.steps=6")
    trainer = Trainer(cfg, DistEnv())
    with caplog.at_level("WARNING", logger="hybridrec"):
        trainer.restore()
    # saved before optim.sparse.eps_form existed, in SparseAdam's form: the default's
    assert "eps_form" not in caplog.text
    other = make_config(*COMMON, *MODELS[name], f"checkpoint.dir={ck}", "train.steps=6")
    other.optim.sparse.eps_form = "adam"
    with caplog.at_level("WARNING", logger="hybridrec"):
        Trainer(other, DistEnv()).restore()
    assert "optim.sparse.eps_form=sparse_adam (written before the key existed)" in caplog.text
    assert trainer.step == 4
    got = trainer.evaluate()
    want = EXPECTED[name]["eval"]
    for key in ("auc", "logloss", "accuracy", "eval_samples"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), (key, got, want)
    losses = trainer.train_batches([trainer.train_batch(s) for s in (4, 5)])
    assert all(torch.isfinite(x) for x in losses)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_old_export_predicts_what_it_did(name):
    model = load_export(FIXTURES / name / "model.pt")
    got = model.predict(*inputs())
    torch.testing.assert_close(got, torch.tensor(EXPECTED[name]["predict"]), rtol=1e-6, atol=1e-7)
