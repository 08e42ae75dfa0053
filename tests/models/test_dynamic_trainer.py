"""A user's model with dynamic tables through the Trainer: its tables' occupancy, admissions
and evictions reach the train rows of metrics.jsonl, evaluation reports the share of unknown
ids, and the export (which carries the maps) scores raw ids as the trainer's evaluation does,
also after a warm start from it (model.init_from keeps the ids' rows)."""

from __future__ import annotations

import json

import torch

from hybridrec.distributed import init_distributed
from hybridrec.inference import load_export
from hybridrec.train.export_cli import main as export_main
from hybridrec.train.trainer import Trainer
from tests.configs import make_config

SMALL = (
    "train.batch_size=32",
    "eval.batch_size=32",
    "eval.batches=2",
    "eval.every=2",
    "train.log_every=1",
    "device=cpu",
    "optim.sparse.name=adagrad",
    "model._target_=tests.models.user_model.DynamicUser",
    "+model.args.dim=4",
)


def test_dynamic_tables_train_log_and_export(tmp_path):
    cfg = make_config(*SMALL, "train.steps=4", f"checkpoint.dir={tmp_path / 'ck'}")
    trainer = Trainer(cfg, init_distributed("cpu"), tmp_path / "run")
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    train = [r for r in rows if r["split"] == "train"]
    last = train[-1]
    assert 0.9 < last["dynamic/a.shared/occupancy"] <= 1.0  # 56 slots, far more ids
    assert last["dynamic/a.shared/evicted"] > 0 and last["dynamic/a.c2/admitted"] > 0
    per_step = sum(r["dynamic/a.shared/admitted_per_step"] for r in train)  # log_every=1
    assert per_step == last["dynamic/a.shared/admitted"]
    evals = [r for r in rows if r["split"] == "eval"]
    assert evals and 0.0 < evals[-1]["dynamic/a.shared/unknown_rate"] < 1.0

    out = tmp_path / "model.pt"
    target = "tests.models.user_model.DynamicUser"
    assert export_main([str(tmp_path / "ck"), str(out), "--model", target]) == 0
    state = torch.load(out, weights_only=True)
    assert state["embeddings.a.shared.slot_id"].shape == (64,)
    assert (state["embeddings.a.shared.slot_id"] >= 0).sum() == 56  # 8 unknown rows
    batch = trainer.train_batch(9)
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.score(batch.dense, batch.ids)
    model = load_export(out, model=target)
    torch.testing.assert_close(model(batch.dense, batch.ids), want, rtol=1e-6, atol=1e-6)
    assert model.predict(batch.dense, batch.ids).shape == (32,)

    warm = make_config(*SMALL, "train.steps=1", f"model.init_from={out}")
    trainer = Trainer(warm, init_distributed("cpu"))
    trainer.restore()
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(trainer.score(batch.dense, batch.ids), want, rtol=0, atol=0)
