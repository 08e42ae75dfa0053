"""Exact mode (train.exact; hybridrec.exact) on W gloo ranks == one process of the same mode,
bit for bit: torch.equal, not a tolerance.

At 1, 2, 3 and 4 ranks (the global batch cut into M = 12 micro-shards, which all four
divide), every step's loss, the evaluation's metrics, every embedding row and optimizer-state
entry, every dynamic map's arrays and every dense weight equal those of `sharding=none` in one
process: table-wise, row-wise and column-wise tables (sgd, adam with mean pooling, row-wise
Adagrad over column shards with L2 decay) through the trainer's DLRM (tests/equivalence.py),
a model with its own loss through the trainer (tests/retrieval/models.L2MF: MSE plus L2 on
the rows it looked up; the branch that also gathers the ranks' dense features and ids), and
a dynamic table (raw ids admitted and evicted, column-wise) and a sequence feature (a row
per position, on dynamic items) through the library (hybridrec.parallelize(exact_shards=...),
hybridrec.exact_step). On 2 ranks, where a run is cheapest, the rest: replicated tables,
auto's mix (split, replicated, jagged, a table two features share), host memory behind caches
that evict, Adagrad, the other dynamic and sequence plans, next_item (SASRec's sampled BCE
with dropout), the Criteo sample (data=criteo_sample, at 1 and 2 ranks; skipped without the
file), and the long runs: LONG_STEPS steps of the trainer's auto plan and of the sequence
model with dynamic items in host memory. Last, a checkpoint saved on 2 ranks, resumed on 3
under another plan, equal to the run that never stopped.

Every run happens once, in a module fixture (one shared process group per world size,
tests/distributed/harness.py run_shared); the tests only compare.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrec.config import Config
from hybridrec.data.source import SAMPLE_ENV
from hybridrec.distributed import DistEnv, init_distributed
from hybridrec.train.trainer import Trainer
from tests.configs import make_config
from tests.distributed import dynamic_model, sequence_model
from tests.distributed.exact_helpers import (
    assert_same_dense,
    assert_same_maps,
    assert_same_tables,
    train_library,
)
from tests.distributed.harness import run_shared
from tests.equivalence import host_cfg, jagged_cfg, make_cfg, snapshot
from tests.retrieval.tables import small_dataset
from tests.sequence.files import write_user_item

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed/test_exact")]

M, STEPS = 12, 5  # micro-shards (divisible by 1, 2, 3, 4), steps of the short runs
LONG_M, LONG_STEPS = 4, 100  # the long runs, on 2 ranks
CRITEO_M, CRITEO_STEPS = 4, 5  # the Criteo sample: 5 batches of 32, its 160 training rows
K, N = 3, 3  # checkpoint: steps before it (on 2 ranks), after it (on 3)


def exact(cfg: Config, m: int = M) -> Config:
    cfg.train.exact, cfg.train.exact_shards = True, m
    cfg.eval.batches = 2
    return cfg


def l2(cfg: Config) -> Config:
    cfg.optim.sparse.weight_decay = 0.01  # the row statistic is of g + wd * w
    return cfg


# name -> (config on `world` ranks: the mode's; its reference: "none" on 1)
TRAINER = {
    "table_wise/sgd": lambda mode, w: make_cfg(mode, "sgd", w),
    "row_wise/adam/mean": lambda mode, w: make_cfg(mode, "adam", w, "mean"),
    "column_wise/rowwise_adagrad/l2": lambda mode, w: l2(make_cfg(mode, "rowwise_adagrad", w)),
    "data_parallel/adagrad": lambda mode, w: make_cfg(mode, "adagrad", w),
    "auto/rowwise_adagrad/jagged": lambda mode, w: jagged_cfg(mode, "rowwise_adagrad", w),
    "host/adam": lambda mode, w: host_cfg(mode, "adam", w),
}
# (sharding, pins, sparse optimizer, the model's variant: dynamic policies / dynamic items)
LIBRARY = {
    "dynamic/row_wise/adagrad": ("row_wise", None, "adagrad", "lfu"),
    "dynamic/column_wise/rowwise_adagrad": ("column_wise", None, "rowwise_adagrad", "ttl"),
    "dynamic/host/adam": ("host", None, "adam", "lfu"),
    "sequence/row_wise/adam": ("row_wise", None, "adam", False),
    "sequence/pinned/rowwise_adagrad": (
        "table_wise",
        {"items.item": "column_wise", "users.user": "row_wise"},
        "rowwise_adagrad",
        True,
    ),
    "sequence/data_parallel/sgd": ("data_parallel", None, "sgd", False),
}
# the cases run at every world size; the others run on 2 ranks (and their references)
EVERY_WORLD = {
    "table_wise/sgd",
    "row_wise/adam/mean",
    "column_wise/rowwise_adagrad/l2",
    "dynamic/column_wise/rowwise_adagrad",
    "sequence/pinned/rowwise_adagrad",
}
LONG_TRAINER = ("auto", "rowwise_adagrad")  # jagged_cfg: split, replicated, shared tables
LONG_LIBRARY = ("host", None, "adam", True)  # the sequence model, dynamic items in host memory


def next_item_cfg(data: Path, sharding: str, world: int) -> Config:
    """SASRec with its sampled BCE over data=sequences (as test_next_item_equivalence's), with
    dropout: each micro-shard's draws come from its own seeded stream."""
    return make_config(
        "data=sequences", f"data.path={data}", "data.sequence.max_len=6", "model=sasrec",
        f"sharding={sharding}", "sharding.cache_fraction=0.5", "model.embedding_dim=8",
        "model.args.dropout=0.1", "optim.sparse.name=adam", "optim.sparse.lr=0.01",
        "optim.dense.name=sgd", "optim.dense.lr=0.1", "train.batch_size=24",
        "eval.batch_size=16", "eval.topk=[3,10]", "device=cpu", "seed=5",
        world_size=world,
    )  # fmt: skip


def own_loss_cfg(data: Path, sharding: str, world: int) -> Config:
    """A user's model with its own loss (L2MF over a small ratings table, data=table)."""
    return make_config(
        "data=table", f"data.path={data}", "model._target_=tests.retrieval.models.L2MF",
        f"sharding={sharding}", "optim.sparse.name=adagrad", "optim.sparse.lr=0.1",
        "optim.dense.name=adam", "optim.dense.lr=0.01", "train.batch_size=24",
        f"train.steps={STEPS}", "eval.batch_size=10", "device=cpu", "seed=5",
        world_size=world,
    )  # fmt: skip


def runs_at(world: int, name: str) -> bool:
    """Whether case `name` runs at `world` ranks (0: its one-process reference)."""
    return world in (0, 2) or name in EVERY_WORLD


def criteo_cfg(sharding: str, world: int, cache: Path) -> Config:
    """The trainer's DLRM on the 200-row Criteo sample ($HYBRIDREC_CRITEO_SAMPLE), its
    preprocessing cached in `cache`."""
    return make_config(
        "data=criteo_sample", f"data.cache_dir={cache}", f"sharding={sharding}",
        "model.embedding_dim=8", "model.bottom_mlp=[16,8]", "model.top_mlp=[16,1]",
        "optim.sparse.name=rowwise_adagrad", "optim.dense.name=sgd", "optim.dense.lr=0.1",
        f"train.steps={CRITEO_STEPS}", "train.batch_size=32", "eval.batch_size=16", "device=cpu",
        "seed=3",
        world_size=world,
    )  # fmt: skip


def trainer_cfg(name: str, world: int, data: Path | None = None) -> Config:
    """Case `name` on `world` ranks, in its mode; world 0: its reference (sharding=none, one
    process). `data`: next_item's file, or criteo's preprocessing cache."""
    ranks, ref = max(world, 1), world == 0
    if name == "criteo":
        assert data is not None
        return exact(criteo_cfg("none" if ref else "row_wise", ranks, data), CRITEO_M)
    if name == "next_item":
        assert data is not None
        return exact(next_item_cfg(data, "none" if ref else "row_wise", ranks), 4)
    if name == "own_loss":
        assert data is not None
        return exact(own_loss_cfg(data, "none" if ref else "row_wise", ranks))
    if name == "long":
        return exact(jagged_cfg("none" if ref else LONG_TRAINER[0], LONG_TRAINER[1], ranks), LONG_M)
    if name == "checkpoint":  # saved on 2 ranks row-wise, resumed on 3 column-wise
        mode = "none" if ref else {2: "row_wise", 3: "column_wise"}[world]
        return exact(jagged_cfg(mode, "rowwise_adagrad", ranks))
    return exact(TRAINER[name]("none" if ref else name.split("/")[0], ranks))


def train_trainer(env: DistEnv, cfg: Config, steps: int) -> dict:
    """`steps` steps through the trainer's pipeline (host caches prefetch), one evaluation."""
    trainer = Trainer(cfg, env)
    batches = [trainer.train_batch(s) for s in range(steps)]
    losses = [trainer.global_mean(loss) for loss in trainer.train_batches(batches)]
    evaluation = trainer.evaluate("test" if cfg.data.name == "sequences" else "eval")
    for m in trainer.embeddings:
        for g in m.host_groups():
            g.flush()
    return {"losses": losses, "eval": evaluation, **snapshot(trainer)}


def fit(env: DistEnv, cfg: Config) -> dict:
    """Trainer.fit to cfg.train.steps (resuming from cfg.checkpoint.dir when one is there)."""
    trainer = Trainer(cfg, env)
    trainer.fit()
    losses = [row["loss"] for row in trainer.history if row["split"] == "train"]
    return {"losses": losses, **snapshot(trainer)}


def jobs(env: DistEnv, todo: list[tuple[str, Any, tuple]]) -> dict[str, Any]:
    """Every job of a world size: (label, function name, arguments)."""
    functions = {"trainer": train_trainer, "library": train_library, "fit": fit}
    return {label: functions[fn](env, *args) for label, fn, args in todo}


def todo(
    world: int, data: Path, ck: Path, cache: Path | None, table: Path
) -> list[tuple[str, str, tuple]]:
    """The jobs of `world` ranks (world 0: the one-process references); `cache`: the Criteo
    sample's preprocessing cache, None without the sample; `table`: own_loss's ratings."""
    out = [("own_loss", "trainer", (trainer_cfg("own_loss", world, table), STEPS))]
    out += [(f"trainer {n}", "trainer", (trainer_cfg(n, world), STEPS))
           for n in TRAINER if runs_at(world, n)]  # fmt: skip
    out += [(f"library {n}", "library", ((("none", None, *c[2:]) if not world else c), STEPS, M))
            for n, c in LIBRARY.items() if runs_at(world, n)]  # fmt: skip
    if cache is not None and world in (0, 1, 2):
        out.append(("criteo", "trainer", (trainer_cfg("criteo", world, cache), CRITEO_STEPS)))
    if world in (0, 2):
        out.append(("next_item", "trainer", (trainer_cfg("next_item", world, data), 4)))
        out.append(("long trainer", "trainer", (trainer_cfg("long", world), LONG_STEPS)))
        case = ("none", None, *LONG_LIBRARY[2:]) if not world else LONG_LIBRARY
        out.append(("long library", "library", (case, LONG_STEPS, LONG_M)))
    if world in (0, 2, 3):
        cfg = trainer_cfg("checkpoint", world)
        cfg.train.steps, cfg.train.log_every = (K if world == 2 else K + N), 1
        cfg.checkpoint.dir, cfg.checkpoint.every = (str(ck) if world else None), K
        out.append(("checkpoint", "fit", (cfg,)))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict[str, list[Any]]]:
    """Per world size (0: the references, one process), per job, the per-rank results."""
    root = tmp_path_factory.mktemp("exact")
    data, ck = write_user_item(root / "events.txt"), root / "checkpoints"
    table = small_dataset(root / "ratings")
    cache = root / "criteo_cache" if os.environ.get(SAMPLE_ENV) else None
    torch.set_num_threads(1)
    one = init_distributed("cpu")
    out: dict[Any, Any] = {"data": data, "root": root, "table": table}
    for world in (0, 1):  # in this process: no group
        out[world] = {k: [v] for k, v in jobs(one, todo(world, data, ck, cache, table)).items()}
    for world in (2, 3, 4):  # the checkpoint's save on 2 before its resume on 3
        ranks = run_shared(world, jobs, todo(world, data, ck, cache, table), timeout=1500)
        out[world] = {label: [r[label] for r in ranks] for label in ranks[0]}
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_trainer_runs_are_one_process_bit_for_bit(runs, world):
    for name in (n for n in TRAINER if runs_at(world, n)):
        label, ref = f"W={world} {name}", runs[0][f"trainer {name}"][0]
        per_rank = runs[world][f"trainer {name}"]
        assert per_rank[0]["losses"] == ref["losses"], f"{label}: losses"
        assert all(r["eval"] == ref["eval"] for r in per_rank), f"{label}: evaluation"
        assert_same_tables(trainer_cfg(name, world), ref, per_rank, label)
        assert_same_dense(ref, per_rank, label)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dynamic_tables_and_sequences_are_one_process_bit_for_bit(runs, world):
    for name in (n for n in LIBRARY if runs_at(world, n)):
        label, ref = f"W={world} {name}", runs[0][f"library {name}"][0]
        per_rank = runs[world][f"library {name}"]
        assert torch.equal(per_rank[0]["losses"], ref["losses"]), f"{label}: losses"
        model = dynamic_model if name.startswith("dynamic") else sequence_model
        assert_same_tables((model.ROWS, model.DIMS), ref, per_rank, label)
        assert_same_dense(ref, per_rank, label)
        assert_same_maps(ref, per_rank, label)


def test_next_item_is_one_process_bit_for_bit(runs):
    ref, per_rank, label = runs[0]["next_item"][0], runs[2]["next_item"], "W=2 next_item"
    assert per_rank[0]["losses"] == ref["losses"], f"{label}: losses"
    assert all(r["eval"] == ref["eval"] for r in per_rank), f"{label}: evaluation"
    assert_same_tables(trainer_cfg("next_item", 2, runs["data"]), ref, per_rank, label)
    assert_same_dense(ref, per_rank, label)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_model_with_its_own_loss_is_one_process_bit_for_bit(runs, world):
    """The own-loss branch (the model's loss reads its outputs with the batch's dense
    features and ids, gathered from every rank): losses, evaluation, rows, dense weights."""
    ref, per_rank, label = runs[0]["own_loss"][0], runs[world]["own_loss"], f"W={world} own"
    assert per_rank[0]["losses"] == ref["losses"], f"{label}: losses"
    assert all(r["eval"] == ref["eval"] for r in per_rank), f"{label}: evaluation"
    assert_same_tables(trainer_cfg("own_loss", world, runs["table"]), ref, per_rank, label)
    assert_same_dense(ref, per_rank, label)


@pytest.mark.parametrize("world", [1, 2])
def test_the_criteo_sample_is_one_process_bit_for_bit(runs, sample_tsv, world):
    """The trainer on real data (data=criteo_sample: its reader, preprocessing, broadcast
    loader, padded last batch) at 1 and 2 ranks, row-wise."""
    ref, per_rank, label = runs[0]["criteo"][0], runs[world]["criteo"], f"W={world} criteo"
    assert len(ref["losses"]) == CRITEO_STEPS
    assert per_rank[0]["losses"] == ref["losses"], f"{label}: losses"
    assert all(r["eval"] == ref["eval"] for r in per_rank), f"{label}: evaluation"
    cfg = trainer_cfg("criteo", world, runs["root"] / "criteo_cache")
    assert_same_tables(cfg, ref, per_rank, label)
    assert_same_dense(ref, per_rank, label)


def test_a_hundred_steps_stay_one_process_bit_for_bit(runs):
    """LONG_STEPS steps on 2 ranks: round-off that an order change leaves at one step would
    grow over them (as the default path's does); exact mode's stays none."""
    world = 2
    ref, per_rank = runs[0]["long trainer"][0], runs[world]["long trainer"]
    assert len(ref["losses"]) == LONG_STEPS
    assert per_rank[0]["losses"] == ref["losses"], f"W={world}: losses"
    assert_same_tables(trainer_cfg("long", world), ref, per_rank, f"W={world} long")
    assert_same_dense(ref, per_rank, f"W={world} long")
    ref, per_rank = runs[0]["long library"][0], runs[world]["long library"]
    assert torch.equal(per_rank[0]["losses"], ref["losses"]), f"W={world}: library losses"
    rows = (sequence_model.ROWS, sequence_model.DIMS)
    assert_same_tables(rows, ref, per_rank, f"W={world} long library")
    assert_same_maps(ref, per_rank, f"W={world} long library")


def test_a_resume_on_another_world_size_is_the_run_that_never_stopped(runs):
    """Saved on 2 ranks (row-wise) after K steps, resumed on 3 (column-wise) to K + N: the
    losses after the resume, the rows, their state and the dense weights are the bits of one
    process's K + N steps."""
    ref = runs[0]["checkpoint"][0]
    saved, resumed = runs[2]["checkpoint"], runs[3]["checkpoint"]
    assert saved[0]["losses"] == ref["losses"][:K]
    assert resumed[0]["losses"] == ref["losses"][K:], "the steps after the resume"
    cfg = trainer_cfg("checkpoint", 3)
    assert_same_tables(cfg, ref, resumed, "resumed on 3")
    assert_same_dense(ref, resumed, "resumed on 3")
