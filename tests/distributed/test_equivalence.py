"""The equivalence principle: sharded training on W gloo ranks == the single-process reference.

For world sizes 1, 2, 3, 4, every sharding mode (table_wise, column_wise, row_wise,
data_parallel, auto) and every sparse optimizer (sgd, rowwise_adagrad, adam, adagrad), we
train a DLRM with 5 tables of very different sizes (3 to 20,000 rows, multi-hot) for several
steps on the same global batches and compare, against `sharding=none` in one process:
  - the forward logits of the first step,
  - the global mean loss of every step,
  - every embedding row and its optimizer state, reassembled from the ranks' shards,
  - every dense weight (and that all ranks' replicas agree).

Tolerance: the sharded run adds the same numbers in a different order (DDP's all-reduce of
dense gradients, the 1/B_l * 1/W gradient scaling instead of 1/B, row-wise partial sums), so
results agree to float32 round-off, not bitwise. After 4 steps the observed gaps are ~1e-7;
we allow rtol=1e-4/atol=1e-5, far below any real bug (a wrong row, a lost update, a missing
1/W scale changes weights by the learning rate times the gradient, >= 1e-3 here).
"""

from __future__ import annotations

import functools

import pytest
import torch

from hybridrec.config import Config
from tests.distributed.harness import run_shared
from tests.equivalence import (
    MODES,
    OPTIMIZERS,
    assemble,
    bf16_tables,
    cached_reference,
    compare,
    dcnv2,
    make_cfg,
    run_all,
)

pytestmark = pytest.mark.slow


def _mode_configs(world: int) -> list[tuple[str, Config]]:
    configs = [(f"{m}/{o}", make_cfg(m, o, world)) for m in MODES for o in OPTIMIZERS]
    configs.append(("row_wise/adam/mean", make_cfg("row_wise", "adam", world, "mean")))
    configs.append(("column_wise/sgd/mean", make_cfg("column_wise", "sgd", world, "mean")))
    return configs


def _dcnv2_configs(world: int) -> list[tuple[str, Config]]:
    return [(f"{m}/adam", dcnv2(make_cfg(m, "adam", world))) for m in ("row_wise", "auto")]


def _bf16_configs(world: int) -> list[tuple[str, Config]]:
    return [
        (f"{m}/sgd", bf16_tables(make_cfg(m, "sgd", world))) for m in ("row_wise", "column_wise")
    ]


def _comm_configs(world: int) -> list[tuple[str, Config]]:
    configs = []
    for mode in ("row_wise", "column_wise"):
        for sparse in ("sgd", "rowwise_adagrad"):
            cfg = make_cfg(mode, sparse, world)
            cfg.sharding.comm_dtype = "bf16"
            configs.append((f"{mode}/{sparse}", cfg))
    return configs


# each test's configs and its world sizes: the configs of one world size, of every test, run
# in one spawn (a process start costs more than a config's few steps)
SUITES = {
    "modes": (_mode_configs, (1, 2, 3, 4)),
    "dcnv2": (_dcnv2_configs, (2, 3)),
    "bf16": (_bf16_configs, (2, 3)),
    "bf16_comms": (_comm_configs, (2, 3)),
}


@functools.cache
def _spawned(world: int) -> dict[str, list[dict]]:
    """Per-rank results of every suite's configs for `world`, by '<suite> <name>'."""
    jobs = [
        (f"{suite} {name}", cfg)
        for suite, (configs, worlds) in SUITES.items()
        if world in worlds
        for name, cfg in configs(world)
    ]
    results = run_shared(world, run_all, jobs)
    return {label: [res[label] for res in results] for label, _ in jobs}


def suite_results(suite: str, world: int) -> list[tuple[str, Config, list[dict]]]:
    """(name, config, per-rank results) of `suite`'s configs on `world` ranks."""
    configs, worlds = SUITES[suite]
    assert world in worlds, (suite, world)
    return [(name, cfg, _spawned(world)[f"{suite} {name}"]) for name, cfg in configs(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_mode_and_optimizer_matches_reference(world):
    for name, cfg, per_rank in suite_results("modes", world):
        mode, sparse = name.split("/")[:2]
        ref = cached_reference(sparse, "mean" if name.endswith("mean") else "sum")
        plan = per_rank[0]["plan"]
        assert all(r["plan"] == plan for r in per_rank), "ranks disagree on the plan"
        if mode == "auto" and world > 1:
            kinds = {tp.table: tp.sharding.value for tp in plan.tables}
            assert kinds["cat_0"] == "data_parallel" and kinds["cat_4"] in (
                "column_wise",
                "row_wise",
            ), kinds
        compare(ref, per_rank, cfg, f"W={world} {name}")


@pytest.mark.parametrize("world", [2, 3])
def test_dcnv2_matches_reference(world):
    """DLRM-DCNv2 (low-rank cross network instead of dot products) under DDP, sharded."""
    ref = cached_reference("adam", variant="dcnv2")
    for name, cfg, per_rank in suite_results("dcnv2", world):
        compare(ref, per_rank, cfg, f"W={world} dcnv2 {name}")


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_tables_match_reference_within_one_rounding(world):
    """bf16 table weights: the sharded run sums in another order, so an fp32 difference of
    round-off size can move a weight across a bf16 rounding boundary. Weights must agree to 2
    bf16 ulps (2^-7 relative); a lost or doubled update moves a row by lr x gradient, far more."""
    ref = cached_reference("sgd", variant="bf16")
    configs = suite_results("bf16", world)
    initial = assemble(configs[0][1], [cached_reference("sgd", variant="bf16", initial=True)])
    for name, cfg, per_rank in configs:
        torch.testing.assert_close(
            torch.tensor(per_rank[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-3, atol=1e-4
        )
        got, want = assemble(cfg, per_rank), assemble(cfg, [ref])
        for table, entries in want.items():
            w, g = entries["weight"].float(), got[table]["weight"].float()
            assert not g.isnan().any()
            torch.testing.assert_close(g, w, rtol=2**-7, atol=1e-6, msg=f"{name} {table}")
            moved = (w - initial[table]["weight"].float()).abs()
            tol = 2**-7 * w.abs() + 1e-6
            assert (moved > 2 * tol).any(), f"{table}: no update the tolerance would not hide"


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_comms_stay_within_rounding_of_the_reference(world):
    """sharding.comm_dtype=bf16 rounds the pooled embeddings and their gradients that cross
    ranks (half the bytes; opt-in). Not exact, so the bound is relative to what training
    did: every weight within 5% of the largest update from the initial weights (a lost or
    doubled update is 100% of one), losses within 1e-3."""
    for name, cfg, per_rank in suite_results("bf16_comms", world):
        sparse = name.split("/")[1]
        ref = cached_reference(sparse)
        initial = assemble(cfg, [cached_reference(sparse, initial=True)])
        torch.testing.assert_close(
            torch.tensor(per_rank[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-3, atol=1e-4
        )
        got, want = assemble(cfg, per_rank), assemble(cfg, [ref])
        for table, entries in want.items():
            update = (entries["weight"] - initial[table]["weight"]).abs().max()
            diff = (got[table]["weight"] - entries["weight"]).abs().max()
            assert update > 0 and diff <= 0.05 * update, (name, table, float(diff), float(update))
