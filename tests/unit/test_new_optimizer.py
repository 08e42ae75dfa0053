"""A sparse optimizer is one class plus its state's declaration: a new one (heavy-ball
momentum SGD, defined here) runs on every backend, in a fused group and in the planner's
sizing, with no code in hybridrec.kernels naming it.

Momentum's maths rounds as torch's ops do in the kernel too (m * mu + g: two roundings, the
weight step one fma), so the torch path, the Triton interpreter and the reference agree bit
for bit. The class registers itself; each test removes it again.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Unpack

import pytest
import torch

from hybridrec.kernels import dispatch, native
from hybridrec.kernels._common import device_function, tl
from hybridrec.kernels.rows import backend
from hybridrec.optim import sparse
from hybridrec.planner import OptimizerFootprint
from hybridrec.sparse.fused import FusedEmbedding, LookupInput
from hybridrec.sparse.layout import full_shard
from hybridrec.types import SPARSE_OPTIMIZER_STATE, StateKind, TableConfig
from tests.rows import same_bits

ROOT = Path(__file__).resolve().parents[2]


@device_function
def _momentum_maths(w, g, m, s1, stat, lr, mu, h2, h3):  # noqa: ANN001, ANN202
    m = m * mu + g
    return tl.fma(m, -lr, w), m, s1


@pytest.fixture
def momentum(monkeypatch):
    """The class SparseMomentum, its state declared as an addition to the types would."""
    monkeypatch.setitem(SPARSE_OPTIMIZER_STATE, "momentum", {"momentum": StateKind.ELEMENT})

    class SparseMomentum(sparse.SparseOptimizer):
        name = "momentum"
        triton = _momentum_maths

        def __init__(self, lr: float, mu: float = 0.9, **decay: Unpack[sparse.Decay]) -> None:
            super().__init__(**decay)  # the weight decay's arguments: the base class's
            self.lr, self.mu = lr, mu

        def scalars(self, step):  # noqa: ANN001, ANN201
            return (self.lr, self.mu)

        def torch_maths(self, grads, state, step, row_sq_mean):  # noqa: ANN001, ANN201
            m = state["momentum"].mul_(self.mu).add_(grads)
            return m, self.lr, {"momentum": m}

    yield SparseMomentum
    sparse._CLASSES.pop("momentum")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_new_optimizer_runs_on_every_backend_bit_for_bit(momentum, monkeypatch, dtype):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    opt = momentum(0.05, 0.8)
    assert opt.state_spec() == {"momentum": StateKind.ELEMENT}
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(50, 130, generator=g).to(dtype)  # two column blocks in the kernel
    state = {"momentum": torch.rand(50, 130, generator=g)}
    runs = {k: (weight.clone(), {"momentum": state["momentum"].clone()}) for k in ("t", "k", "r")}
    for step in (1, 2, 3):
        rows = torch.randperm(50, generator=g)[:17]
        grads = torch.randn(17, 130, generator=g)
        with dispatch.use_kernels("torch"), native.disabled():
            w, st = runs["t"]
            assert backend(opt, w, st, rows, grads) == "torch"  # native is None: torch ops
            opt.update(w, st, rows, grads, step)
        w, st = runs["k"]
        assert backend(opt, w, st, rows, grads) == "triton"
        opt.update(w, st, rows, grads, step)
        sparse.reference_update(opt, *runs["r"], rows, grads, step)
    for k in ("k", "r"):
        same_bits(runs[k][0], runs["t"][0])
        same_bits(runs[k][1]["momentum"], runs["t"][1]["momentum"])
    assert not torch.equal(runs["t"][0], weight)


def test_a_new_optimizer_trains_a_group_and_is_sized_and_built(momentum):
    table = TableConfig("t", 40, 8, hotness=2)
    opt = momentum(0.1)
    group = FusedEmbedding([(table, 0, full_shard(table))], opt, seed=1)
    assert group.state()["momentum"].shape == (40, 8)
    before = group.weight.clone()
    ids = torch.tensor([3, 3, 7, 1])
    out = group([LookupInput(ids, torch.tensor([0, 0, 1, 1]), 2)])[0]
    out.sum().backward()
    touched = torch.zeros(40, dtype=torch.bool)
    touched[ids] = True
    assert not torch.equal(group.weight[touched], before[touched])
    assert torch.equal(group.weight[~touched], before[~touched])
    state_bytes = sum(t.numel() * t.element_size() for t in group.state().values())
    footprint = OptimizerFootprint.of_state(opt.state_spec().values())
    assert state_bytes == footprint.bytes_for(40, 8) == 40 * 8 * 4

    class Cfg:  # optim.sparse's keys; the class takes the ones its constructor names
        name, lr, mu, eps = "momentum", 0.3, 0.5, 1e-8
        weight_decay, weight_decay_mode, table_weight_decay = 0.0, "l2", None

    built = sparse.build_sparse_optimizer(Cfg)
    assert isinstance(built, momentum) and (built.lr, built.mu) == (0.3, 0.5)


def test_a_new_optimizer_takes_weight_decay_from_the_base_class(momentum):
    """Decay is the base class's: the new class's **decay reaches it, checked and applied by
    every backend around the class's maths (decoupled: w * (1 - lr * wd), then the step)."""
    with pytest.raises(ValueError, match="weight_decay must be a finite number >= 0"):
        momentum(0.1, weight_decay=-1.0)
    decay = {
        "weight_decay": 0.2,
        "weight_decay_mode": "decoupled",
        "table_weight_decay": {"a.t": 0},
    }
    opt = momentum(0.1, 0.5, **decay)
    assert opt.weight_decay_for("a.t") == 0.0 and opt.weight_decay_for("b.t") == 0.2
    assert "weight_decay_mode='decoupled'" in repr(opt)
    weight, rows, grads = torch.ones(6, 3), torch.tensor([1, 4]), torch.full((2, 3), 0.5)
    state = {"momentum": torch.zeros(6, 3)}
    with native.disabled():
        opt.update(weight, state, rows, grads, 1)
    want = torch.ones(6, 3)
    want[rows] = 1.0 * (1 - 0.1 * 0.2) - 0.1 * 0.5
    torch.testing.assert_close(weight, want)
    assert torch.equal(state["momentum"][rows], grads)


def test_a_class_without_declared_state_is_refused():
    with pytest.raises(TypeError, match="declare the state of 'lamb' in hybridrec.types"):

        class Lamb(sparse.SparseOptimizer):
            name = "lamb"


def test_the_architecture_recipe_names_every_file_that_lists_the_optimizers():
    """docs/architecture.md's "A sparse optimizer" recipe stays true: each file it names
    exists, and each test module that names every optimizer (by name or by class: a list of
    them) is one it names, so that a new optimizer following it runs in every suite."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    recipe = text[text.index("**A sparse optimizer**") : text.index("**A sharding mode**")]
    named = set(re.findall(r"`((?:hybridrec|tests|docs|conf)/[\w/.]+\.\w+)`", recipe))
    assert len(named) > 20 and not [p for p in named if not (ROOT / p).is_file()]
    names = [f'"{n}"' for n in SPARSE_OPTIMIZER_STATE]
    classes = [f"{cls.__name__}(" for cls in sparse._CLASSES.values()]
    # its optimizers are the benchmark's (SPARSE_OPTIMIZERS), which it reads back by name
    reads_a_report = {"tests/train/test_benchmarks_smoke.py"}
    lists = {
        str(f.relative_to(ROOT))
        for f in (ROOT / "tests").rglob("*.py")
        if all(n in f.read_text() for n in names) or all(c in f.read_text() for c in classes)
    }
    assert lists - reads_a_report <= named, sorted(lists - reads_a_report - named)
