"""Sparse weight decay (hybridrec.kernels.decay) on every optimizer and backend.

The reference is written from the formulas in numpy fp32, element by element, independent of
the backends' code: for each touched row, w its stored values in fp32 and wd its decay,
    l2:        g <- g + (w * wd)              decoupled: w <- w * (1 - (lr * wd))
then the optimizer's step, each product and sum rounded once, the weight step one fma
(`_fma32`), sqrt correctly rounded (numpy's). Row-wise Adagrad's statistic is the mean of g^2
(the L2 g) over the row, summed in torch's order (the one thing taken from torch: the torch
and C paths both take it from torch.mean); where the Triton kernel sums it itself, it is
compared to round-off, and bit for bit where the statistic is given.

Backends, each bit for bit against the reference: torch ops (its sqrt made correctly rounded:
torch's CPU sqrt is 1 ulp off for a few inputs, tests/unit/test_native_rows.py), the C kernels,
the Triton kernels under TRITON_INTERPRET=1 and `reference_update` (the index-op path), for
one decay for all rows and one per row, fp32 and bf16 (fp16 on Triton) weights.
Also: laziness (untouched rows keep their values and state), equality with torch.optim's
weight_decay / AdamW where every row is touched, a group of tables with different decays
equal to each table alone, and the one-line errors of the optimizers, config and parallelize.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrec.kernels import dispatch, native
from hybridrec.kernels._common import _fma32
from hybridrec.kernels.decay import decay_of
from hybridrec.kernels.rows import backend
from hybridrec.kernels.segment import dedupe
from hybridrec.optim.sparse import (
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseSGD,
    reference_update,
)
from hybridrec.sparse.fused import FusedEmbedding
from hybridrec.types import ShardSpec, TableConfig
from tests.rows import bag_batch, same_bits

LR = {"sgd": 0.3, "adagrad": 0.1, "rowwise_adagrad": 0.1, "adam": 0.05}
MAKE = {
    "sgd": lambda **kw: SparseSGD(LR["sgd"], **kw),
    "adagrad": lambda **kw: SparseAdagrad(LR["adagrad"], eps=1e-8, **kw),
    "rowwise_adagrad": lambda **kw: RowWiseAdagrad(LR["rowwise_adagrad"], eps=1e-8, **kw),
    "adam": lambda **kw: SparseAdam(LR["adam"], 0.9, 0.999, 1e-8, **kw),
}
MODES = ["l2", "decoupled"]
ROWS, U = 60, 25


def formula_step(opt, weight, state, rows, grads, step, wd, row_sq=None) -> None:
    """The reference: one step of `opt` on weight[rows] and its state, in place, in numpy fp32
    (module docstring). wd: [U] the rows' decays."""
    f32 = np.float32
    w = weight.index_select(0, rows).float().numpy()
    g = grads.numpy().copy()
    d = wd.numpy().astype(f32)[:, None]
    if opt.weight_decay_mode == "l2":
        g = g + w * d
    else:
        w = w * (f32(1) - f32(opt.lr) * d)
    lr, eps = f32(opt.lr), f32(getattr(opt, "eps", 0.0))
    st = {k: v.index_select(0, rows).numpy().copy() for k, v in state.items()}
    if opt.name == "sgd":
        w = _fma32(g, -lr, w)
    elif opt.name == "adagrad":
        st["sum"] = _fma32(g, g, st["sum"])
        w = _fma32(g / (np.sqrt(st["sum"]) + eps), -lr, w)
    elif opt.name == "rowwise_adagrad":
        if row_sq is None:  # summed in torch's order, as the torch and C paths take it
            stat = torch.from_numpy(g).pow(2).mean(dim=1).numpy()
        else:
            stat = row_sq.numpy()
        st["sum"] = st["sum"] + stat
        w = _fma32(g / (np.sqrt(st["sum"]) + eps)[:, None], -lr, w)
    else:  # adam
        c1, c2 = f32(1 - opt.beta1), f32(1 - opt.beta2)
        m, v = st["exp_avg"], st["exp_avg_sq"]
        m = (g - m) * c1 + m
        v = (g * g - v) * c2 + v
        st["exp_avg"], st["exp_avg_sq"] = m, v
        # eps as the step adds it to the raw sqrt(v) (SparseAdam.step_eps: either eps form)
        w = _fma32(m / (np.sqrt(v) + f32(opt.step_eps(step))), f32(-opt.step_size(step)), w)
    weight[rows] = torch.from_numpy(w.astype(f32)).to(weight.dtype)
    for k in state:
        state[k][rows] = torch.from_numpy(st[k].astype(f32))


def _case(name: str, dtype: torch.dtype, seed: int, width: int = 19):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(ROWS, width, generator=g).to(dtype)
    opt = MAKE[name]()
    state = {k: torch.rand(kind.shape(ROWS, width), generator=g) for k, kind in
             opt.state_spec().items()}  # fmt: skip
    return weight, state, g


def _steps(g: torch.Generator, width: int, per_row: bool, n: int = 3):
    """n steps' (rows [U] unique, grads [U, width], decay: [U] per row or a float)."""
    out = []
    for _ in range(n):
        rows = torch.randperm(ROWS, generator=g)[:U]
        grads = torch.randn(U, width, generator=g)
        if per_row:  # three tables' decays, one of them 0
            wd = torch.tensor([0.0, 0.05, 0.4])[torch.randint(0, 3, (U,), generator=g)]
        else:
            wd = 0.2
        out.append((rows, grads, wd))
    return out


def _run(opt, weight, state, steps, path: str, row_sq=None) -> None:
    for k, (rows, grads, wd) in enumerate(steps, 1):
        decay = wd if isinstance(wd, torch.Tensor) else None  # uniform: the optimizer's own
        stat = row_sq[k - 1] if row_sq is not None else None
        if path == "formula":
            wd_rows = wd if isinstance(wd, torch.Tensor) else torch.full((rows.numel(),), wd)
            formula_step(opt, weight, state, rows, grads, k, wd_rows, stat)
        elif path == "reference_update":
            reference_update(opt, weight, state, rows, grads, k, stat, weight_decay=decay)
        else:
            assert backend(opt, weight, state, rows, grads, stat, decay) == path
            opt.update(weight, state, rows, grads, k, stat, weight_decay=decay)


def _compare(name, mode, dtype, per_row, path, given_stat=False, width=19):
    """`path`'s three steps == the formula's, bit for bit."""
    weight, state, g = _case(name, dtype, seed=len(name) + width, width=width)
    steps = _steps(g, width, per_row)
    row_sq = [torch.rand(U, generator=g) for _ in steps] if given_stat else None
    runs = {}
    for p in ("formula", path):
        opt = MAKE[name](weight_decay=0.2, weight_decay_mode=mode)
        w, st = weight.clone(), {k: v.clone() for k, v in state.items()}
        _run(opt, w, st, steps, p, row_sq)
        runs[p] = (w, st)
    (w_ref, st_ref), (w, st) = runs["formula"], runs[path]
    same_bits(w, w_ref, f"{path} {name} {mode} weight")
    for k in st:
        same_bits(st[k], st_ref[k], f"{path} {name} {mode} {k}")
    assert not torch.equal(w, weight), "nothing moved"


@pytest.mark.parametrize("name", sorted(MAKE))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_equal_the_formula(name, mode, per_row, dtype, exact_sqrt):
    with native.disabled(), dispatch.use_kernels("torch"):
        _compare(name, mode, dtype, per_row, "torch")
        _compare(name, mode, dtype, per_row, "reference_update")
        if name == "rowwise_adagrad":  # a column shard's given statistic
            _compare(name, mode, dtype, per_row, "torch", given_stat=True)


@pytest.mark.skipif(native.lib() is None, reason="no C compiler: torch path only")
@pytest.mark.parametrize("name", sorted(MAKE))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_row", [False, True])
def test_native_kernels_equal_the_formula(name, mode, per_row, exact_sqrt):
    with dispatch.use_kernels("torch"):  # the CPU's choice: C where it loads
        _compare(name, mode, torch.float32, per_row, "native")
        if name == "rowwise_adagrad":
            _compare(name, mode, torch.float32, per_row, "native", given_stat=True)


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("HYBRIDREC_KERNELS", raising=False)


@pytest.mark.parametrize("name", sorted(MAKE))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernels_equal_the_formula(name, mode, per_row, dtype, interpreter):
    if name != "rowwise_adagrad":
        _compare(name, mode, dtype, per_row, "triton", width=130)  # two column blocks
        return
    _compare(name, mode, dtype, per_row, "triton", given_stat=True, width=130)
    # the kernel sums mean(g^2) itself, in its own order: round-off in the statistic only
    weight, state, g = _case(name, dtype, seed=5, width=130)
    steps = _steps(g, 130, per_row)
    opt = MAKE[name](weight_decay=0.2, weight_decay_mode=mode)
    ref = (weight.clone(), {k: v.clone() for k, v in state.items()})
    _run(opt, weight, state, steps, "triton")
    _run(opt, *ref, steps, "formula")
    torch.testing.assert_close(state["sum"], ref[1]["sum"], rtol=1e-6, atol=0)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(weight.float(), ref[0].float(), rtol=eps, atol=1e-6)


@pytest.mark.parametrize("name", sorted(MAKE))
def test_untouched_rows_do_not_decay(name):
    """Lazy: only the rows an update names change, weight and state; a row given a zero
    gradient still decays (it was touched): each value moves toward 0, by exactly the
    mode's formula where the formula is a plain shrink."""
    weight, state, g = _case(name, torch.float32, seed=1)
    state = {k: torch.zeros_like(v) for k, v in state.items()}  # fresh: only decay moves
    for mode in MODES:
        w, st = weight.clone(), {k: v.clone() for k, v in state.items()}
        rows = torch.tensor([3, 10, 41])
        MAKE[name](weight_decay=0.5, weight_decay_mode=mode).update(
            w, st, rows, torch.zeros(3, w.shape[1]), 1
        )
        untouched = torch.ones(ROWS, dtype=torch.bool)
        untouched[rows] = False
        same_bits(w[untouched], weight[untouched], mode)
        for k in st:
            same_bits(st[k][untouched], state[k][untouched], f"{mode} {k}")
        moved = w[rows] - weight[rows]
        assert (moved * weight[rows] < 0).all(), f"{name} {mode}: touched rows move toward 0"
        if name == "sgd" or mode == "decoupled":
            # sgd's L2 step is lr * wd * w; decoupled shrinks by that, and then the
            # adaptive step of a zero gradient and zero state is 0
            keep = (1 - torch.tensor(0.5) * torch.tensor(LR[name])).item()
            torch.testing.assert_close(w[rows], weight[rows] * keep, rtol=1e-6, atol=0)


def test_zero_decay_is_the_undecayed_update():
    """weight_decay=0 (and a table override of 0) is NO_DECAY: the same bits as no decay."""
    for name in MAKE:
        weight, state, g = _case(name, torch.float32, seed=2)
        rows, grads = torch.randperm(ROWS, generator=g)[:U], torch.randn(U, 19, generator=g)
        runs = []
        for opt in (MAKE[name](), MAKE[name](weight_decay=0.0, table_weight_decay={"t": 0.0})):
            w, st = weight.clone(), {k: v.clone() for k, v in state.items()}
            assert decay_of(opt).kind == 0
            opt.update(w, st, rows, grads, 1, weight_decay=opt.weight_decay_for("t"))
            runs.append((w, st))
        same_bits(runs[0][0], runs[1][0], name)


@pytest.mark.parametrize(
    "name,dense",
    [
        ("sgd", lambda p, mode: torch.optim.SGD(p, lr=LR["sgd"], weight_decay=0.1)),
        ("adagrad", lambda p, mode: torch.optim.Adagrad(  # decoupled: the shrink by hand
            p, lr=LR["adagrad"], eps=1e-8, weight_decay=0.1 if mode == "l2" else 0.0)),
        ("adam", lambda p, mode: (torch.optim.Adam if mode == "l2" else torch.optim.AdamW)(
            p, lr=LR["adam"], eps=1e-8, weight_decay=0.1)),
    ],
)  # fmt: skip
@pytest.mark.parametrize("mode", MODES)
def test_every_row_touched_equals_torch_optim(name, dense, mode):
    """Touching every row every step, the sparse optimizer is torch.optim's with weight_decay
    (L2: the decay added to the gradient; Adam's decoupled mode: AdamW; SGD's two modes are
    the same maths; decoupled Adagrad: w *= 1 - lr * wd, then torch's Adagrad). fp32
    round-off: torch computes 1 - lr * wd in fp64."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(ROWS, 6, generator=g)
    param = torch.nn.Parameter(weight.clone())
    torch_opt = dense([param], mode)
    opt = MAKE[name](weight_decay=0.1, weight_decay_mode=mode)
    state = {k: torch.zeros(kind.shape(ROWS, 6)) for k, kind in opt.state_spec().items()}
    for step in range(1, 6):
        grads = torch.randn(ROWS, 6, generator=g)
        opt.update(weight, state, torch.arange(ROWS), grads, step)
        param.grad = grads.clone()
        if name == "adagrad" and mode == "decoupled":
            with torch.no_grad():
                param.mul_(1 - LR["adagrad"] * 0.1)
        torch_opt.step()
    torch.testing.assert_close(weight, param.detach(), rtol=1e-5, atol=1e-6)


def _group(opt, sizes=(30, 50)):
    tables = [TableConfig(f"t{i}", n, 8) for i, n in enumerate(sizes)]
    shards = [(t, i, ShardSpec(t.name, 0, 0, t.num_rows, 0, 8)) for i, t in enumerate(tables)]
    return FusedEmbedding(shards, opt)


@pytest.mark.parametrize("name", sorted(MAKE))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kernels", ["torch", "native", "triton"])
def test_a_group_of_tables_with_their_own_decays(name, mode, kernels, monkeypatch):
    """Two tables fused in one group, each with its own decay (a per-row decay the kernels
    read; the Triton path padded, with no host sync) == each table's rows updated with its
    decay alone, bit for bit, on every backend."""
    if kernels == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    decays = {"t0": 0.3, "t1": 0.02}
    opt = MAKE[name](weight_decay=0.02, weight_decay_mode=mode, table_weight_decay={"t0": 0.3})
    group = _group(opt)
    ref = _group(MAKE[name](weight_decay_mode=mode))
    with native.disabled() if kernels == "torch" else dispatch.use_kernels("auto"):
        for step in (1, 2, 3):
            ids, bags, grad = bag_batch(400, 80, 90, 8, seed=step)
            group.apply_gradient(ids, bags, None, grad)
            # the reference: the same rows and gradients, each table's slice with its decay
            rows, grads = dedupe(ids, bags, None, grad)
            ref.step_count += 1
            for i, spec in enumerate(ref.shards):
                mine = (rows >= ref.offsets_list[i]) & (rows < ref.offsets_list[i + 1])
                ref.optimizer.update(
                    ref.weight, ref.state(), rows[mine], grads[mine], ref.step_count,
                    weight_decay=decays[spec.table],
                )  # fmt: skip
            same_bits(group.weight, ref.weight, f"{kernels} step {step}")
            for k, v in group.state().items():
                same_bits(v, ref.state()[k], f"{kernels} step {step} {k}")
    assert isinstance(group.row_decay(torch.arange(80)), torch.Tensor)
    assert _group(MAKE[name](weight_decay=0.1)).row_decay(torch.arange(80)) == 0.1


def test_optimizers_refuse_bad_decay_in_one_line():
    for bad, match in (
        ({"weight_decay": -0.1}, r"weight_decay must be a finite number >= 0, got -0\.1"),
        ({"weight_decay": float("nan")}, "weight_decay must be a finite number >= 0"),
        ({"weight_decay_mode": "adamw"}, "weight_decay_mode='adamw' is not one of: l2, "),
        ({"table_weight_decay": {"users.user": -1}}, r"table_weight_decay\['users.user'\]"),
    ):
        for make in MAKE.values():
            with pytest.raises(ValueError, match=match):
                make(**bad)
    opt = SparseAdam(0.01, weight_decay=0.1, table_weight_decay={"a.b": 0.0})
    assert opt.weight_decay_for("a.b") == 0.0 and opt.weight_decay_for("c") == 0.1


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["optim.sparse.weight_decay=-0.1"], r"^optim.sparse.weight_decay must be >= 0, got -0.1$"),
        (
            ["optim.sparse.weight_decay_mode=adamw"],
            r"^optim.sparse.weight_decay_mode='adamw' is not one of: l2, decoupled$",
        ),
        (
            ["optim.sparse.table_weight_decay={cat_9:0.1}"],
            r"^optim.sparse.table_weight_decay.cat_9: model dlrm_tiny has no table 'cat_9'",
        ),
        (
            ["optim.sparse.table_weight_decay={cat_1:-1}"],
            r"^optim.sparse.table_weight_decay.cat_1 must be >= 0, got -1.0$",
        ),
        (
            ["+optim.sparse.table_weight_decay.users.user=0.1"],
            r"a table name with a dot \(users.user\) is given as "
            r"'optim.sparse.table_weight_decay=\{users.user: 0.01\}'",
        ),
    ],
)
def test_config_refuses_bad_decay_in_one_line(overrides, message):
    from tests.configs import make_config

    with pytest.raises(ValueError, match=message):
        make_config(*overrides)


def test_config_and_library_build_the_same_optimizer():
    """optim.sparse.* -> the optimizer hybridrec.parallelize takes (builder), and parallelize
    refuses a per-table decay for a table the model does not declare."""
    from torch import nn

    import hybridrec
    from hybridrec import EmbeddingTables, Feature, Table
    from hybridrec.builder import parallelize_options
    from tests.configs import make_config

    cfg = make_config(
        "optim.sparse.name=adam", "optim.sparse.weight_decay=0.01",
        "optim.sparse.weight_decay_mode=decoupled", "optim.sparse.table_weight_decay={cat_2:0.5}",
    )  # fmt: skip
    opt = parallelize_options(cfg)["sparse_optimizer"]
    assert isinstance(opt, SparseAdam) and opt.weight_decay_mode == "decoupled"
    assert opt.weight_decay_for("cat_2") == 0.5 and opt.weight_decay_for("cat_0") == 0.01
    assert "table_weight_decay={'cat_2': 0.5}" in repr(opt)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.users = EmbeddingTables([Table("user", 10, 4)], [Feature("user_id", "user")])

    bad = SparseSGD(0.1, table_weight_decay={"users.usr": 0.1})
    with pytest.raises(ValueError, match=r"names unknown table\(s\) users.usr; the model's "
                                         r"tables are users.user"):  # fmt: skip
        hybridrec.parallelize(Model(), batch_size=4, sparse_optimizer=bad, sharding="none")
    hybridrec.parallelize(
        Model(), batch_size=4, sparse_optimizer=SparseSGD(0.1, table_weight_decay={"users.user": 0.1}),
        sharding="none",
    )  # fmt: skip


@pytest.mark.parametrize("sparse,mode", [("rowwise_adagrad", "l2"), ("adam", "decoupled")])
def test_a_decayed_triton_step_has_no_syncing_op(sparse, mode, monkeypatch):
    """Per-table decays in DLRM's one fused group (a per-row decay the kernels read) add no
    op that makes CUDA wait: the step stays sync-free (tests/unit/test_no_sync_ops.py)."""
    pytest.importorskip("triton")
    from hybridrec.distributed import DistEnv
    from hybridrec.train.trainer import Trainer
    from tests.equivalence import make_cfg
    from tests.syncs import SyncRecorder, unrecorded_launches

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    unrecorded_launches(monkeypatch)
    cfg = make_cfg("none", sparse, 1)
    cfg.train.kernels = "triton"
    cfg.train.check_ids = False
    cfg.optim.sparse.weight_decay, cfg.optim.sparse.weight_decay_mode = 0.01, mode
    cfg.optim.sparse.table_weight_decay = {"cat_1": 0.2, "cat_3": 0.0}
    try:
        trainer = Trainer(cfg, DistEnv(device=torch.device("cpu")))
        [group] = [g.store for m in trainer.embeddings for g in m.groups.values()]
        assert isinstance(group.row_decay(torch.arange(5)), torch.Tensor)  # per row
        batches = [trainer.train_batch(s) for s in range(3)]
        trainer.train_step(batches[0])
        with SyncRecorder() as rec:
            for b in batches[1:]:
                trainer.train_step(b)
    finally:
        dispatch.set_kernels("auto")
    assert rec.total > 200
    assert not rec.syncs, f"ops that make CUDA wait for the device: {rec.unexpected()}"
