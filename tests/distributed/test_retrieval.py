"""Retrieval and a model's own loss on W gloo ranks == the single-process reference.

For W = 1, 2, 3, 4 (the session's shared group of each size), on a leave-last-out
implicit-feedback table (tests/retrieval/tables.py):
- model.task=retrieval through the Trainer: the built-in two_tower (with tower MLPs, unit
  vectors, logQ, sampled negatives, accidental hits removed; and embeddings only) and a
  user's own retrieval model with an L2 term in its own loss, in every sharding mode, host
  caches included: per-step global losses, every row and its optimizer state, every dense
  weight, and the full-catalogue evaluation (hr/recall/ndcg@K and every user's top-K list,
  ties by item id) on val (seen: train) and test (seen: train and val);
- a model's own loss on a regression task (matrix factorisation with L2 on the rows it
  looked up) through the Trainer;
- hybridrec.retrieval_loss in a user's own loop, with the group;
- hybridrec-export --retrieval of the W-rank run's checkpoint: its topk gives the
  one-process evaluation's lists.
Tolerances as tests/distributed/test_equivalence.py (float32 round-off); top-K item lists
must be identical (the evaluation batch, 10, leaves padding on 3 and 4 ranks).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hybridrec
from hybridrec.config import Config
from hybridrec.distributed import DistEnv, init_distributed
from hybridrec.model import load_export
from hybridrec.optim import RowWiseAdagrad
from hybridrec.sparse.api import embedding_modules
from hybridrec.train.export_cli import main as export_main
from hybridrec.train.trainer import Trainer
from tests.configs import make_config
from tests.distributed.harness import run_shared
from tests.equivalence import assemble, snapshot
from tests.retrieval.tables import small_dataset, split_rows

# the module's tests share one module-scoped fixture: one test worker runs them all, so it
# is built once (scripts/test.sh: pytest-xdist --dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed/test_retrieval")]

STEPS, BATCH = 4, 24
TWO_TOWER = [
    "model.arch=two_tower",
    "model.task=retrieval",
    "+model.args.user_features=[user_id]",
    "+model.args.item_features=[item_id]",
]
CASES = {  # name -> overrides (sharding added per world size)
    "mlp_logq_negatives": [
        *TWO_TOWER,
        "+model.args.tower_mlp=[12]",
        "+model.args.normalize=true",
        "train.retrieval.temperature=0.2",
        "train.retrieval.negatives=5",
        "train.retrieval.remove_accidental_hits=true",
        "optim.sparse.name=rowwise_adagrad",
        "optim.sparse.lr=0.1",
    ],
    "embeddings_only": [
        *TWO_TOWER,
        "+model.args.tower_mlp=[]",
        "train.retrieval.logq=false",
        "optim.sparse.name=sgd",
        "optim.sparse.lr=0.5",
    ],
    "user_model_own_loss": [
        "model._target_=tests.retrieval.models.RegularisedRetrieval",
        "model.task=retrieval",
        "train.retrieval.negatives=3",
        "optim.sparse.name=adam",
        "optim.sparse.lr=0.02",
    ],
    "mf_own_loss": [
        "model._target_=tests.retrieval.models.L2MF",
        "optim.sparse.name=adagrad",
        "optim.sparse.lr=0.1",
    ],
}
MODES = {  # case -> the sharding modes it runs in on several ranks
    "mlp_logq_negatives": ["row_wise", "column_wise", "host"],
    "embeddings_only": ["table_wise", "data_parallel", "host"],
    "user_model_own_loss": ["row_wise", "host"],
    "mf_own_loss": ["row_wise"],
}


def make_cfg(data: Path, case: str, sharding: str, world: int) -> Config:
    return make_config(
        "data=table",
        f"data.path={data}",
        f"sharding={sharding}",
        "sharding.cache_fraction=0.5",  # host: caches of half the rows (evictions happen)
        "optim.dense.name=adam",
        "optim.dense.lr=0.01",
        f"train.batch_size={BATCH}",
        "eval.batch_size=10",
        "eval.topk=[3,10]",
        "eval.batches=2",
        f"train.steps={STEPS}",
        "device=cpu",
        "seed=5",
        *CASES[case],
        world_size=world,
    )


def train_and_collect(env: DistEnv, cfg: Config) -> dict:
    trainer = Trainer(cfg, env)
    batches = [trainer.train_batch(s) for s in range(STEPS)]
    losses = [trainer.global_mean(loss) for loss in trainer.train_batches(batches)]
    out: dict = {"losses": losses}
    if cfg.model.task == "retrieval":
        for split in ("eval", "test"):
            metrics, lists = trainer.evaluate_topk(split, whole=True, lists=True)
            out[split] = (metrics, lists)
        out["partial"] = trainer.evaluate()  # eval.batches of the val split
    else:
        out["eval"] = trainer.evaluate(whole=True)
    for m in trainer.embeddings:
        for g in m.host_groups():
            g.flush()  # host tables: cached rows back into host memory
    if cfg.checkpoint.dir:  # exported after the spawn: its topk against the reference's lists
        trainer.save()
    return {**out, **snapshot(trainer)}


def run_cases(env: DistEnv, configs: list[tuple[str, Config]]) -> dict:
    return {name: train_and_collect(env, cfg) for name, cfg in configs}


# -- a user's own loop ---------------------------------------------------------------------


class LoopModel(nn.Module):
    """Query: user rows through a linear layer; candidates: item rows."""

    def __init__(self) -> None:
        super().__init__()
        self.users = hybridrec.EmbeddingTables([hybridrec.Table("user", 40, 8)])
        self.items = hybridrec.EmbeddingTables([hybridrec.Table("item", 90, 8)])
        self.tower = nn.Linear(8, 8)

    def forward(self, ids: hybridrec.KeyedIds, negatives: torch.Tensor):  # noqa: ANN201
        items = torch.cat([ids.select(["item"]), negatives.view(-1, 1)])
        return self.tower(self.users(ids)["user"]), self.items(items)["item"]


def own_loop(group) -> dict:  # noqa: ANN001
    torch.manual_seed(0)
    model = hybridrec.parallelize(
        LoopModel(), batch_size=BATCH, sparse_optimizer=RowWiseAdagrad(0.1), group=group,
        sharding="row_wise" if group is not None else "none", seed=3,
    )  # fmt: skip
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        users = torch.randint(0, 40, (BATCH, 1), generator=g)
        items = (torch.rand(BATCH, 1, generator=g) ** 2 * 90).long()  # popular items repeat
        negatives = torch.randint(0, 90, (4,), generator=g)
        log_q = torch.rand(90, generator=g).log()
        part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        ids = hybridrec.KeyedIds(torch.cat([users, items], 1)[part], ["user", "item"], [1, 1])
        query, candidates = model(ids, negatives)
        item_ids = torch.cat([items[part].view(-1), negatives])
        loss = hybridrec.retrieval_loss(
            query, candidates, item_ids, group=group, temperature=0.3, log_q=log_q[item_ids],
            remove_accidental_hits=True,
        )  # fmt: skip
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        losses.append(float(total) / world)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    rows = {}
    for m in embedding_modules(inner):
        for spec, w, st in m.shard_views():
            rows.setdefault(spec.table, []).append((spec.row_start, spec.row_end, w, st["sum"]))
    return {"losses": losses, "rows": rows, "tower": inner.tower.weight.detach().clone()}


def whole(parts: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> tuple:
    parts = sorted(parts, key=lambda p: p[0])
    return torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts])


# -- the test ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return small_dataset(tmp_path_factory.mktemp("retrieval"))


@functools.cache
def reference(data: Path, case: str) -> dict:
    torch.set_num_threads(1)
    return train_and_collect(init_distributed("cpu"), make_cfg(data, case, "none", 1))


def run_all(env: DistEnv, configs: list[tuple[str, Config]]) -> dict:
    return {"cases": run_cases(env, configs), "own_loop": own_loop(env.group)}


def configs(data: Path, world: int) -> list[tuple[str, Config]]:
    out = [
        (f"{case}/{mode}", make_cfg(data, case, mode, world))
        for case, modes in MODES.items()
        for mode in modes
    ]
    out[0][1].checkpoint.dir = str(data.parent / f"checkpoints_{world}")  # exported below
    return out


def check_export(data: Path, world: int, want: tuple) -> None:
    """hybridrec-export --retrieval of the W-rank run's checkpoint ranks the test split's
    users as the one-process run's evaluation did."""
    out = data.parent / f"model_{world}.pt"
    assert export_main([str(data.parent / f"checkpoints_{world}"), str(out), "--retrieval"]) == 0
    model = load_export(out)
    firsts, seen = {}, {}
    for u, i, age in split_rows(data, "test"):
        firsts.setdefault(u, (i, age))
    for split in ("train", "val"):
        for u, i, _ in split_rows(data, split):
            seen.setdefault(u, []).append(i)
    _, lists = want
    users = lists.users.tolist()
    dense = torch.tensor([[firsts[u][1]] for u in users], dtype=torch.float32)
    ids = torch.tensor([[u, firsts[u][0]] for u in users])
    k = lists.items.shape[1]
    items, scores = model.topk(dense, ids, k, exclude=[seen.get(u, []) for u in users])
    assert torch.equal(items, lists.items), f"W={world}: exported top-K lists"
    torch.testing.assert_close(scores, lists.scores, rtol=1e-4, atol=1e-5)


def same_lists(got: tuple, want: tuple, label: str) -> None:
    (gm, gl), (wm, wl) = got, want
    assert gm.keys() == wm.keys(), label
    for k in wm:
        assert gm[k] == pytest.approx(wm[k], rel=1e-9, abs=1e-12), f"{label} {k}"
    assert torch.equal(gl.users, wl.users), f"{label}: users"
    assert torch.equal(gl.items, wl.items), f"{label}: top-K items"
    torch.testing.assert_close(gl.scores, wl.scores, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_retrieval_and_own_losses_match_one_process(data, world):
    ranks = run_shared(world, run_all, configs(data, world), timeout=900)
    results = {"cases": [r["cases"] for r in ranks], "own_loop": [r["own_loop"] for r in ranks]}
    tol = {"rtol": 1e-4, "atol": 1e-5}
    for case, modes in MODES.items():
        ref = reference(data, case)
        cfg = make_cfg(data, case, "none", 1)
        for mode in modes:
            label = f"W={world} {case}/{mode}"
            per_rank = [r[f"{case}/{mode}"] for r in results["cases"]]
            torch.testing.assert_close(
                torch.tensor(per_rank[0]["losses"]), torch.tensor(ref["losses"]), **tol
            )
            got, want = assemble(cfg, per_rank), assemble(cfg, [ref])
            for table, entries in want.items():
                for name, value in entries.items():
                    assert not got[table][name].isnan().any(), f"{label} {table}.{name}: gaps"
                    torch.testing.assert_close(
                        got[table][name], value, **tol,
                        msg=lambda m, t=table, n=name, c=label: f"{c} {t}.{n}: {m}",
                    )  # fmt: skip
            for r in per_rank:
                for k, v in ref["dense"].items():
                    torch.testing.assert_close(r["dense"][k], v, **tol)
            if cfg.model.task != "retrieval":
                for r in per_rank:
                    assert r["eval"]["rmse"] == pytest.approx(ref["eval"]["rmse"], rel=1e-5)
                continue
            for r in per_rank:  # every rank holds the same, exact lists
                same_lists(r["eval"], ref["eval"], f"{label} val")
                same_lists(r["test"], ref["test"], f"{label} test")
                assert r["partial"] == pytest.approx(ref["partial"], rel=1e-9)
    first = next(iter(MODES))
    check_export(data, world, reference(data, first)["test"])
    want = own_loop(None)
    for r in results["own_loop"]:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want["losses"]), **tol)
        torch.testing.assert_close(r["tower"], want["tower"], **tol)
    for table, parts in want["rows"].items():
        every = [p for r in results["own_loop"] for p in r["rows"][table]]
        for got, ref_part in zip(whole(every), whole(parts), strict=True):
            torch.testing.assert_close(got, ref_part, **tol)
