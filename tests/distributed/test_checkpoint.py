"""Checkpoints: exact round trips across plans and world sizes, resume == uninterrupted,
export / warm start, and clear errors for corrupt or mismatched checkpoints.

A checkpoint saved under one plan on W ranks is loaded under another plan on W' ranks; the
weights and optimizer state reassembled from the new shards must be bitwise equal to the
saved ones. Training then continues; the result must equal a single-process run that never
stopped (float32 round-off tolerance, as in test_equivalence).

Every run of every case happens once, in a module fixture: the runs of one world size share
one spawn (stages in STAGES order, each running the jobs whose checkpoint exists by then),
each case in its own checkpoint directory; a failing job names its case. The tests then
only compare.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hybridrec.sparse.api import embedding_modules
from hybridrec.train.checkpoint import export_checkpoint, list_checkpoints
from hybridrec.train.checkpoint.format import dense_state, shard_views
from hybridrec.train.trainer import Trainer
from tests.distributed.harness import run_jobs, spawn_jobs
from tests.equivalence import assemble, jagged_cfg, make_cfg

# the module's tests share one module-scoped fixture: one test worker runs them all, so it
# is built once (scripts/test.sh: pytest-xdist --dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed/test_checkpoint")]
K, M = 3, 3  # steps before the checkpoint, steps after it
# (save plan, load plan, sparse optimizer[, model]): the model of test_equivalence, or
# "jagged": list features, mixed widths, a table two features share (test_jagged_equivalence)
CASES = [
    (("table_wise", 4), ("column_wise", 2), "adam"),
    (("row_wise", 3), ("none", 1), "adam"),
    (("column_wise", 2), ("row_wise", 3), "adam"),
    (("none", 1), ("auto", 3), "adam"),
    (("host", 2), ("table_wise", 3), "adam"),  # host tables flush their caches into the checkpoint
    (("row_wise", 2), ("host", 3), "adam"),  # ... and reload cached rows after a load
    # element-wise Adagrad's sums [rows, cols] (named like row-wise Adagrad's [rows]): column
    # slices reassembled into row ranges behind host caches
    (("column_wise", 2), ("host", 3), "adagrad"),
    (("column_wise", 2), ("row_wise", 3), "rowwise_adagrad", "jagged"),
    # a model class (model.arch=two_tower): four collections, tables named "<path>.<table>"
    (("row_wise", 2), ("column_wise", 3), "rowwise_adagrad", "two_tower"),
]
TWO_TOWER = (
    "model.arch=two_tower",
    "+model.args.user_features=[cat_0,cat_1]",
    "+model.args.item_features=[cat_2,cat_3,cat_4]",
    "+model.args.tower_mlp=[8]",
)
# world sizes in run order: each stage runs, in one spawn, every job of that size whose
# checkpoint is written by then (saves on 4 before the loads on 2, on 2 before those on 3)
STAGES = (1, 4, 2, 3, 1)


def _scheduled(cfg):
    """Warm-up then decay across the checkpoint: a resume must continue the schedule at
    step K + 1 (factors .5, 1, 1 | .58, .33, .25)."""
    s = cfg.optim.schedule
    s.warmup_steps, s.decay_start, s.decay_steps, s.end_factor = 2, K, M, 0.25
    return cfg


def _model_cfg(mode, sparse, world, model="dlrm"):
    if model == "jagged":
        return jagged_cfg(mode, sparse, world)
    if model == "two_tower":
        return make_cfg(mode, sparse, world, "sum", *TWO_TOWER)
    return make_cfg(mode, sparse, world)


def _cfg(mode, world, ck_dir, steps, sparse="adam", model="dlrm"):
    cfg = _scheduled(_model_cfg(mode, sparse, world, model))
    cfg.sharding.cache_fraction = 0.001  # host mode: small caches, so checkpoints flush
    cfg.checkpoint.dir, cfg.checkpoint.every = str(ck_dir), K
    cfg.train.steps, cfg.eval.batches = steps, 1
    return cfg


def _shards(model):
    return [
        (spec, w.clone(), {k: v.clone() for k, v in st.items()})
        for spec, w, st in shard_views(embedding_modules(model))
    ]


def fit_and_collect(env, cfg):
    trainer = Trainer(cfg, env)
    trainer.fit()
    return {
        "shards": _shards(trainer.model),
        "dense": {k: v.clone() for k, v in dense_state(trainer.model).items()},
        "step": trainer.step,
    }


def load_and_resume(env, cfg):
    """Load the checkpoint without training (cfg's steps == K), then continue to K + M."""
    loaded = fit_and_collect(env, cfg)
    if env.group is not None:
        dist.barrier(group=env.group)
    cfg.train.steps = K + M
    return {"loaded": loaded, "resumed": fit_and_collect(env, cfg)}


def init_only(env, cfg):
    trainer = Trainer(cfg, env)
    trainer.restore()
    return {"shards": _shards(trainer.model)}


@dataclass
class Job:
    label: str
    world: int
    fn: Any
    cfg: Any
    after: str | None = None  # the job whose checkpoint this one reads
    prepare: Any = None  # run here once `after` is done, before this job


def _run_stage(world: int, jobs: list[Job]) -> dict[str, Any]:
    """Per-job list of per-rank results; one process (no spawn) for sharding=none on 1."""
    batch = [(j.label, j.fn, (j.cfg,)) for j in jobs]
    if world == 1 and all(j.cfg.sharding.type == "none" for j in jobs):
        from hybridrec.distributed import init_distributed

        torch.set_num_threads(1)
        return {k: [v] for k, v in run_jobs(init_distributed("cpu"), batch).items()}
    return spawn_jobs(world, batch)


def _label(save, load, sparse, model="dlrm") -> str:
    return f"{save[0]}@{save[1]}->{load[0]}@{load[1]}/{sparse}/{model}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Results (per job label, per rank) of every case's save, load and resume, of the
    export test's save and warm start, and the uninterrupted single-process reference."""
    root = tmp_path_factory.mktemp("checkpoints")
    jobs: list[Job] = []
    for save, load, *how in CASES:
        label = _label(save, load, *how)
        ck = root / f"{save[0]}{save[1]}_to_{load[0]}{load[1]}_{'_'.join(how)}"
        jobs.append(Job(f"{label} save", save[1], fit_and_collect, _cfg(*save, ck, K, *how)))
        load_cfg = _cfg(*load, ck, K, *how)
        jobs.append(Job(f"{label} load", load[1], load_and_resume, load_cfg, f"{label} save"))
    export = {"ck": root / "export_ck", "out": root / "model.pt"}

    def do_export():
        export["checkpoints"] = [p.name for p in list_checkpoints(export["ck"])]
        export["shapes"] = export_checkpoint(list_checkpoints(export["ck"])[-1], export["out"])

    warm = make_cfg("column_wise", "adam", 3)
    warm.model.init_from, warm.train.steps = str(export["out"]), 1
    jobs.append(Job("export save", 2, fit_and_collect, _cfg("row_wise", 2, export["ck"], K)))
    jobs.append(Job("export warm", 3, init_only, warm, "export save", do_export))

    results: dict[str, Any] = {}
    checkpoints: dict[str, list[str]] = {}
    for world in STAGES:
        stage = [
            j
            for j in jobs
            if j.world == world and j.label not in results and (j.after in results or not j.after)
        ]
        for j in stage:
            if j.prepare is not None:
                j.prepare()
            if j.fn is load_and_resume:  # what the save left, before the load adds to it
                checkpoints[j.label] = [
                    p.name for p in list_checkpoints(Path(j.cfg.checkpoint.dir))
                ]
        if stage:
            results.update(_run_stage(world, stage))
    assert set(results) == {j.label for j in jobs}, "a job STAGES never runs"
    refs = {}
    for how in sorted({(c[2], *c[3:]) for c in CASES}):
        ref_cfg = _scheduled(_model_cfg("none", how[0], 1, *how[1:]))
        ref_cfg.train.steps, ref_cfg.eval.batches = K + M, 1
        [ref] = _run_stage(1, [Job("reference", 1, fit_and_collect, ref_cfg)])["reference"]
        refs[how] = (ref_cfg, [ref])
    return {
        "jobs": {j.label: j for j in jobs},
        "results": results,
        "refs": refs,
        "checkpoints": checkpoints,
        "export": export,
    }


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


@pytest.mark.parametrize("case", CASES, ids=lambda c: _label(*c))
def test_checkpoint_reshards_exactly_and_training_continues(runs, case):
    save, load, *how = case
    label = _label(save, load, *how)
    jobs, results = runs["jobs"], runs["results"]
    cfg_a, saved = jobs[f"{label} save"].cfg, results[f"{label} save"]
    assert runs["checkpoints"][f"{label} load"] == [f"step_{K}"]
    # loaded under the other plan without training: bitwise the saved state
    cfg_b = jobs[f"{label} load"].cfg
    loaded = [r["loaded"] for r in results[f"{label} load"]]
    assert loaded[0]["step"] == K
    _assert_same(cfg_a, saved, cfg_b, loaded, exact=True, label=f"{save}->{load} load")
    # continued to K + M steps: equals a single process that never stopped
    resumed = [r["resumed"] for r in results[f"{label} load"]]
    ref_cfg, ref = runs["refs"][tuple(how)]
    _assert_same(ref_cfg, ref, cfg_b, resumed, exact=False, label=f"{save}->{load} resumed")


def test_export_names_shapes_and_warm_start(runs):
    export, jobs, results = runs["export"], runs["jobs"], runs["results"]
    cfg, saved = jobs["export save"].cfg, results["export save"]
    assert export["checkpoints"] == [f"step_{K}"]
    shapes = export["shapes"]
    tables = cfg.model.tables()
    for t in tables:
        assert shapes[f"embeddings.{t.name}.weight"] == [t.num_rows, t.dim]
    assert "dense.bottom.0.weight" in shapes and "dense.top.2.bias" in shapes
    exported = torch.load(export["out"], weights_only=True)
    full = assemble(cfg, saved)
    for t in tables:
        assert torch.equal(exported[f"embeddings.{t.name}.weight"], full[t.name]["weight"])
    # warm start another run (column-wise, 3 ranks) from the file: same weights, fresh state
    warm = jobs["export warm"].cfg
    rebuilt = assemble(warm, results["export warm"])
    for t in tables:
        assert torch.equal(rebuilt[t.name]["weight"], full[t.name]["weight"])
        assert float(rebuilt[t.name]["exp_avg"].abs().sum()) == 0.0
