"""Checkpoints: exact round trips across plans and world sizes, resume == uninterrupted,
export / warm start, and clear errors for corrupt or mismatched checkpoints.

A checkpoint saved under one plan on W ranks is loaded under another plan on W' ranks; the
weights and optimizer state reassembled from the new shards must be bitwise equal to the
saved ones. Training then continues; the result must equal a single-process run that never
stopped (float32 round-off tolerance, as in test_equivalence).
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.train.checkpoint import export_checkpoint, list_checkpoints
from hybridrec.train.trainer import Trainer
from tests.distributed.harness import spawn
from tests.distributed.test_equivalence import assemble, make_cfg

pytestmark = pytest.mark.slow
K, M = 3, 3  # steps before the checkpoint, steps after it


def _scheduled(cfg):
    """Warm-up then decay across the checkpoint: a resume must continue the schedule at
    step K + 1 (factors .5, 1, 1 | .58, .33, .25)."""
    s = cfg.optim.schedule
    s.warmup_steps, s.decay_start, s.decay_steps, s.end_factor = 2, K, M, 0.25
    return cfg


def _cfg(mode, world, ck_dir, steps, sparse="adam"):
    cfg = _scheduled(make_cfg(mode, sparse, world))
    cfg.sharding.cache_fraction = 0.001  # host mode: small caches, so checkpoints flush
    cfg.checkpoint.dir, cfg.checkpoint.every = str(ck_dir), K
    cfg.train.steps, cfg.eval.batches = steps, 1
    return cfg


def fit_and_collect(env, cfg):
    trainer = Trainer(cfg, env)
    trainer.fit()
    return {
        "shards": [
            (spec, w.clone(), {k: v.clone() for k, v in st.items()})
            for spec, w, st in trainer.model.embeddings.shard_views()
        ],
        "dense": {
            k.removeprefix("module."): v.clone()
            for k, v in trainer.model.dense.state_dict().items()
        },
        "step": trainer.step,
    }


def _run(world, cfg):
    if world == 1 and cfg.sharding.type == "none":
        from hybridrec.distributed import init_distributed

        torch.set_num_threads(1)
        return [fit_and_collect(init_distributed("cpu"), cfg)]
    return spawn(world, fit_and_collect, cfg)


def _assert_same(a_cfg, a_res, b_cfg, b_res, exact, label):
    got, want = assemble(b_cfg, b_res), assemble(a_cfg, a_res)
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-5}
    for table, entries in want.items():
        for name, value in entries.items():
            torch.testing.assert_close(
                got[table][name],
                value,
                **tol,
                msg=lambda m, t=table, n=name: f"{label} {t}.{n}: {m}",
            )
    for k, v in a_res[0]["dense"].items():
        torch.testing.assert_close(b_res[0]["dense"][k], v, **tol)


@pytest.mark.parametrize(
    "save,load",
    [
        (("table_wise", 4), ("column_wise", 2)),
        (("row_wise", 3), ("none", 1)),
        (("column_wise", 2), ("row_wise", 3)),
        (("none", 1), ("auto", 3)),
        (("host", 2), ("table_wise", 3)),  # host tables flush their caches into the checkpoint
        (("row_wise", 2), ("host", 3)),  # ... and reload cached rows after a load
    ],
)
def test_checkpoint_reshards_exactly_and_training_continues(tmp_path, save, load):
    (mode_a, w_a), (mode_b, w_b) = save, load
    cfg_a = _cfg(mode_a, w_a, tmp_path, K)
    saved = _run(w_a, cfg_a)
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step_{K}"]
    # load under the other plan without training: bitwise the saved state
    cfg_b = _cfg(mode_b, w_b, tmp_path, K)
    loaded = _run(w_b, cfg_b)
    assert loaded[0]["step"] == K
    _assert_same(cfg_a, saved, cfg_b, loaded, exact=True, label=f"{save}->{load} load")
    # continue to K + M steps; equals a single process that never stopped
    cfg_b.train.steps = K + M
    resumed = _run(w_b, cfg_b)
    ref_cfg = _scheduled(make_cfg("none", "adam", 1))
    ref_cfg.train.steps, ref_cfg.eval.batches = K + M, 1
    ref = _run(1, ref_cfg)
    _assert_same(ref_cfg, ref, cfg_b, resumed, exact=False, label=f"{save}->{load} resumed")


def test_export_names_shapes_and_warm_start(tmp_path):
    cfg = _cfg("row_wise", 2, tmp_path / "ck", K)
    saved = spawn(2, fit_and_collect, cfg)
    out = tmp_path / "model.pt"
    shapes = export_checkpoint(list_checkpoints(tmp_path / "ck")[-1], out)
    tables = cfg.model.tables()
    for t in tables:
        assert shapes[f"embeddings.{t.name}.weight"] == [t.num_rows, t.dim]
    assert "dense.bottom.0.weight" in shapes and "dense.top.2.bias" in shapes
    exported = torch.load(out, weights_only=True)
    full = assemble(cfg, saved)
    for t in tables:
        assert torch.equal(exported[f"embeddings.{t.name}.weight"], full[t.name]["weight"])
    # warm start another run (column-wise, 3 ranks) from the file: same weights, fresh state
    warm = make_cfg("column_wise", "adam", 3)
    warm.model.init_from, warm.train.steps = str(out), 1
    got = spawn(3, init_only, warm)
    rebuilt = assemble(warm, got)
    for t in tables:
        assert torch.equal(rebuilt[t.name]["weight"], full[t.name]["weight"])
        assert float(rebuilt[t.name]["exp_avg"].abs().sum()) == 0.0


def init_only(env, cfg):
    trainer = Trainer(cfg, env)
    trainer.restore()
    return {
        "shards": [
            (spec, w.clone(), {k: v.clone() for k, v in st.items()})
            for spec, w, st in trainer.model.embeddings.shard_views()
        ]
    }
