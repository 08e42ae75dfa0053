"""The native CPU kernels (hybridrec.kernels.native) equal the torch path bit for bit.

The dedupe and SGD are compared with the torch path as it is. Adagrad, row-wise Adagrad and
Adam are compared with the torch path whose sqrt is correctly rounded: torch's CPU sqrt is
not (about 15% of its fp32 results are 1 ulp off), the native one is, as the GPU kernels'
sqrt_rn. Also: the build (cache dir, reuse) and the fallback when no compiler is found.
"""

from __future__ import annotations

import logging

import pytest
import torch

from hybridrec.kernels import cpu_rows, native
from hybridrec.kernels.segment import dedupe_any_order
from tests.rows import OPTIMIZERS, bag_batch, random_state, same_bits, two_table_groups

pytestmark = pytest.mark.skipif(native.lib() is None, reason="no C compiler: torch path only")


@pytest.mark.parametrize("width", [1, 3, 32, 40])
@pytest.mark.parametrize("scale", ["none", "float", "tensor"])
@pytest.mark.parametrize("hot", [0, 3])
def test_hashed_dedupe_sums_each_row_as_the_sorted_one(width, scale, hot):
    rows, bags, grad = bag_batch(5000, 3000, 700, width, seed=width + hot, hot=hot)
    s = {"none": None, "float": 0.25, "tensor": torch.rand(5000)}[scale]
    got_rows, got = native.dedupe_hashed(rows, bags, s, grad)
    want_rows, want = cpu_rows.dedupe_sorted(rows, bags, s, grad)
    # rows in first-occurrence order, every distinct row once
    assert got_rows.tolist() == list(dict.fromkeys(rows.tolist()))
    order = torch.argsort(got_rows)
    same_bits(got_rows[order], want_rows)
    same_bits(got[order], want)


def test_hashed_dedupe_of_nothing_large_ids_and_bf16_gradients():
    rows, got = native.dedupe_hashed(
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        None,
        torch.zeros(0, 4),
    )
    assert rows.shape == (0,) and got.shape == (0, 4)
    big = torch.tensor([2**40, 5, 2**40, 2**33], dtype=torch.int64)
    bags = torch.tensor([0, 0, 1, 1])
    grad = torch.randn(2, 8).bfloat16()
    got_rows, got = native.dedupe_hashed(big, bags, None, grad)
    assert got_rows.tolist() == [2**40, 5, 2**33]
    same_bits(got[0], grad[0].float() + grad[1].float())
    same_bits(got[2], grad[1].float())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("width", [1, 3, 32])
@pytest.mark.parametrize("row_stat", [False, True])
def test_update_equals_the_torch_path(name, width, row_stat, exact_sqrt):
    opt = OPTIMIZERS[name]()
    weight = torch.randn(300, width)
    state = random_state(opt, 300, width)
    w_ref, s_ref = weight.clone(), {k: v.clone() for k, v in state.items()}
    g = torch.Generator().manual_seed(width)
    for step in (1, 2, 3):
        rows = torch.randperm(300, generator=g)[:120]  # unique, any order
        grads = torch.randn(120, width, generator=g)
        stat = torch.rand(120, generator=g) if row_stat else None
        opt.update(weight, state, rows, grads, step, stat)
        with native.disabled():
            opt.update(w_ref, s_ref, rows, grads, step, stat)
        same_bits(weight, w_ref)
        for k in state:
            same_bits(state[k], s_ref[k])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_group_backward_equals_the_torch_path(name, exact_sqrt):
    """FusedEmbedding's backward (hashed dedupe, native update) on two tables with repeated
    ids and mean pooling equals the torch path's (sorted dedupe, torch ops) over 3 steps."""
    group, ref = two_table_groups(OPTIMIZERS[name])
    for step in (1, 2, 3):
        rows, bags, grad = bag_batch(9000, 450, 2000, 8, seed=step, hot=4)
        scale = torch.full((9000,), 0.5)
        group.apply_gradient(rows, bags, scale, grad)
        with native.disabled():
            ref.apply_gradient(rows, bags, scale, grad)
        same_bits(group.weight, ref.weight)
        for k, v in group.state().items():
            same_bits(v, ref.state()[k])


def test_low_precision_tables_and_non_cpu_inputs_take_the_torch_path():
    weight = torch.randn(10, 4).bfloat16()
    assert not native.usable(torch.arange(3), inplace=(weight,))
    assert not native.usable(torch.arange(3), inplace=(torch.randn(10, 8)[:, :4],))
    assert native.usable(torch.arange(3), torch.randn(8, 3).t(), inplace=(torch.randn(10, 4),))


def test_build_reuses_the_library_and_without_a_compiler_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HYBRIDREC_CACHE_DIR", str(tmp_path))
    path = native.build()
    assert path.parent == tmp_path and path.exists()
    mtime = path.stat().st_mtime_ns
    assert native.build() == path and path.stat().st_mtime_ns == mtime  # built once
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.lib() is None
    assert "no C compiler found" in caplog.text and "using torch ops" in caplog.text
    rows, got = dedupe_any_order(
        torch.tensor([3, 1, 3]), torch.tensor([0, 1, 1]), None, torch.ones(2, 2)
    )
    assert rows.tolist() == [1, 3]  # the sorted torch path
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("HYBRIDREC_NATIVE", "0")
    assert native.lib() is None
