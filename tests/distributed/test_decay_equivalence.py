"""Sparse weight decay under the equivalence principle: sharded == one process, at 1-4 ranks.

The DLRM of tests/distributed/test_equivalence.py (5 tables of 3 to 20,000 rows, all of width
8: one fused group per rank holds several tables) trains 4 steps with weight decay on, in both
modes (l2, decoupled), with every sparse optimizer, and with a per-table override
(`optim.sparse.table_weight_decay={cat_2: 0.3, cat_4: 0.0}`: a group whose tables decay
differently, so its kernels read one decay per row). Row-wise Adagrad runs column-wise too:
under L2 its full-row statistic is the mean of (g + wd * w)^2 over all columns, each owner
adding its columns' share (hybridrec.sparse.exchange.row_stats), so sharded == unsharded.
Logits, losses, every row and its optimizer state, and the dense weights are compared with
the single-process run of the same config, as test_equivalence.compare does (float32
round-off). The decay is strong enough to matter: a run without it, or without the
override, is far outside that tolerance.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hybridrec.config import Config
from tests.distributed.harness import run_shared
from tests.equivalence import (
    assemble,
    cached_reference,
    compare,
    make_cfg,
    reference,
    reference_initial,
    run_all,
)

pytestmark = pytest.mark.slow

OVERRIDE = "optim.sparse.table_weight_decay={cat_2:0.3,cat_4:0.0}"
CASES = [  # (sharding, sparse optimizer, decay mode)
    ("column_wise", "rowwise_adagrad", "l2"),
    ("column_wise", "rowwise_adagrad", "decoupled"),
    ("auto", "rowwise_adagrad", "l2"),
    ("row_wise", "sgd", "l2"),
    ("data_parallel", "sgd", "decoupled"),
    ("table_wise", "adagrad", "l2"),
    ("row_wise", "adagrad", "decoupled"),
    ("column_wise", "adam", "l2"),
    ("auto", "adam", "decoupled"),
]


def decay_cfg(mode: str, sparse: str, decay: str, world: int, override: bool = True) -> Config:
    extra = [
        "optim.sparse.weight_decay=0.05",
        f"optim.sparse.weight_decay_mode={decay}",
        *([OVERRIDE] if override else []),
    ]
    return make_cfg(mode, sparse, world, "sum", *extra)


@functools.cache
def decay_reference(sparse: str, decay: str, override: bool = True) -> dict:
    return reference(decay_cfg("none", sparse, decay, 1, override))


def _configs(world: int) -> list[tuple[str, Config]]:
    return [(f"{m}/{o}/{d}", decay_cfg(m, o, d, world)) for m, o, d in CASES]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_weight_decay_matches_one_process(world):
    configs = _configs(world)
    results = run_shared(world, run_all, configs)
    for name, cfg in configs:
        mode, sparse, decay = name.split("/")
        per_rank = [r[name] for r in results]
        plan = per_rank[0]["plan"]
        if mode == "column_wise" and world > 1:
            assert any(len(tp.shards) > 1 for tp in plan.tables), "no table was split"
        compare(decay_reference(sparse, decay), per_rank, cfg, f"W={world} {name}")


def _apart(a: dict, b: dict, cfg: Config, table: str | None = None) -> float:
    """How far outside compare()'s tolerance two runs' weights are (or one table's): the
    largest |a - b| / (1e-5 + 1e-4 |b|); within it is <= 1."""
    got, want = assemble(cfg, [a]), assemble(cfg, [b])
    names = [table] if table else list(want)
    return max(
        float(((got[t]["weight"] - w).abs() / (1e-5 + 1e-4 * w.abs())).max())
        for t in names
        for w in [want[t]["weight"]]
    )


@pytest.mark.parametrize("sparse", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("decay", ["l2", "decoupled"])
def test_the_decay_and_its_override_change_the_run(sparse, decay):
    """The comparison above could not pass by accident: without the decay the rows end far
    outside its tolerance (10x), and the overridden table's rows with its own value; the two
    modes differ where the optimizer is adaptive."""
    cfg = decay_cfg("none", sparse, decay, 1)
    decayed = decay_reference(sparse, decay)
    assert _apart(decayed, cached_reference(sparse), cfg) > 10
    assert _apart(decayed, decay_reference(sparse, decay, override=False), cfg, "cat_2") > 10
    if decay == "decoupled" and sparse != "sgd":  # SGD's two modes are the same maths
        assert _apart(decayed, decay_reference(sparse, "l2"), cfg) > 10


def test_untouched_rows_of_a_decayed_run_keep_their_initial_values():
    """Lazy decay: the 20,000-row table's rows that no batch of the run touched hold their
    initial values, bit for bit, while touched rows decayed."""

    cfg = decay_cfg("none", "adam", "decoupled", 1)
    initial = assemble(cfg, [reference_initial(cfg)])["cat_4"]["weight"]
    final = assemble(cfg, [decay_reference("adam", "decoupled")])["cat_4"]["weight"]
    same = (final == initial).all(dim=1)
    assert same.any() and (~same).any(), "some rows touched, most not"
    state = assemble(cfg, [decay_reference("adam", "decoupled")])["cat_4"]["exp_avg_sq"]
    assert torch.equal(same, (state == 0).all(dim=1)), "unchanged rows == rows never touched"


# -- a user's model through hybridrec.parallelize (tests/distributed/test_library.py) ---------

# qualified table names: the users group (user, age: width 8) and the items group (item,
# genre: width 4) each hold two tables of different decays
TABLE_DECAY = {"users.user": 0.2, "items.genre": 0.0}
LIBRARY_CASES = [  # (sharding, pins, optimizer/decay mode)
    ("column_wise", None, "rowwise_adagrad/l2"),
    ("row_wise", None, "adam/decoupled"),
    ("host", None, "adagrad/l2"),
    ("host", None, "rowwise_adagrad/l2"),
    ("data_parallel", None, "sgd/decoupled"),
    ("auto", None, "sgd/l2"),
    ("column_wise", None, "adam/l2"),
    ("table_wise", {"users.user": "row_wise", "items.item": "column_wise"}, "adagrad/decoupled"),
    ("table_wise", {"users.user": "column_wise"}, "rowwise_adagrad/decoupled"),
]


def _decayed(key: str):  # noqa: ANN202
    from tests import libmodel as lib

    name, mode = key.split("/")
    base = lib.OPTIMIZERS[name]()
    params = {k: v for k, v in vars(base).items() if k in ("lr", "eps", "beta1", "beta2")}
    return lambda: type(base)(
        **params, weight_decay=0.05, weight_decay_mode=mode, table_weight_decay=TABLE_DECAY
    )


def _library_train(group, sharding, pins, key):  # noqa: ANN001, ANN202
    """test_library.train with the decayed optimizer `key` (known to it for this call only:
    a shared group's next job finds test_library as it was)."""
    from tests import libmodel as lib

    lib.OPTIMIZERS[key] = _decayed(key)
    try:
        return lib.train(group, sharding, pins, key)
    finally:
        del lib.OPTIMIZERS[key]


def run_library_cases(env, cases):  # noqa: ANN001, ANN201
    return [_library_train(env.group, *case) for case in cases]


@functools.cache
def library_reference(key: str) -> dict:
    torch.set_num_threads(1)
    return _library_train(None, "none", None, key)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_user_model_with_decay_matches_one_process(world):
    from tests.libmodel import full_tables, one_process

    results = run_shared(world, run_library_cases, LIBRARY_CASES)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    for k, (sharding, pins, key) in enumerate(LIBRARY_CASES):
        label = f"W={world} {sharding} {pins or ''} {key}"
        ref = library_reference(key)
        per_rank = [r[k] for r in results]
        torch.testing.assert_close(
            torch.tensor(per_rank[0]["losses"]), torch.tensor(ref["losses"]), **tol
        )
        got, want = full_tables(per_rank), full_tables([ref])
        undecayed = full_tables([one_process(key.split("/")[0])])
        for table, entries in want.items():
            for name, value in entries.items():
                assert not got[table][name].isnan().any(), f"{label} {table}.{name}: gaps"
                torch.testing.assert_close(
                    got[table][name], value, **tol,
                    msg=lambda m, t=table, n=name, c=label: f"{c} {t}.{n}: {m}",
                )  # fmt: skip
        w, w0 = want["users.user"]["weight"], undecayed["users.user"]["weight"]
        outside = ((w - w0).abs() / (1e-5 + 1e-4 * w0.abs())).max()
        assert outside > 10, f"{label}: the decay is within the tolerance ({outside:.3g})"
        for name, value in ref["dense"].items():
            for r in per_rank:
                torch.testing.assert_close(r["dense"][name], value, **tol)
