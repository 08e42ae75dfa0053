"""The CPU sparse backward's torch path (hybridrec.kernels.cpu_rows and the optimizers' torch ops,
taken where the native kernels are not: tests/unit/test_native_rows.py) equals the former path
(dedupe_reference, reference_update) bit for bit, and is deterministic."""

from __future__ import annotations

import pytest
import torch

from hybridrec.kernels import native
from hybridrec.kernels.cpu_rows import (
    apply_delta,
    copy_rows,
    dedupe_reference,
    dedupe_sorted,
    gather_rows,
)
from hybridrec.optim.sparse import reference_update
from tests.rows import OPTIMIZERS, bag_batch, random_state, same_bits, two_table_groups


@pytest.fixture(autouse=True)
def _torch_path():
    """Keep the native kernels out: these are the torch path's tests."""
    with native.disabled():
        yield


@pytest.mark.parametrize("width", [1, 3, 32, 40])
@pytest.mark.parametrize("scale", ["none", "float", "tensor"])
@pytest.mark.parametrize("hot", [0, 3])
def test_dedupe_equals_the_reference_bit_for_bit(width, scale, hot):
    rows, bags, grad = bag_batch(3000, 500, 700, width, seed=width + hot, hot=hot)
    s = {"none": None, "float": 0.25, "tensor": torch.rand(rows.numel()) + 0.1}[scale]
    u, g = dedupe_sorted(rows, bags, s, grad)
    u_ref, g_ref = dedupe_reference(rows, bags, s, grad)
    same_bits(u, u_ref)
    same_bits(g, g_ref)


def test_dedupe_sums_each_row_in_id_order_from_zero():
    """The order is the contract (the same bits on every CPU): each row's sum is 0 + g_1 +
    g_2 + ... over its ids in input order, one fp32 add at a time, as a plain loop adds."""
    rows, bags, grad = bag_batch(600, 40, 150, 5, seed=11, hot=3)
    scale = torch.rand(600) + 0.5
    u, g = dedupe_sorted(rows, bags, scale, grad)
    for k, row in enumerate(u.tolist()):
        acc = torch.zeros(5)
        for i in (rows == row).nonzero().squeeze(1).tolist():
            acc = acc + grad[bags[i]] * scale[i]
        same_bits(g[k], acc)


def test_dedupe_of_low_precision_gradients_and_of_nothing():
    rows, bags, grad = bag_batch(500, 50, 80, 16, seed=1, hot=2)
    for dtype in (torch.float16, torch.bfloat16):
        for got, want in zip(
            dedupe_sorted(rows, bags, None, grad.to(dtype)),
            dedupe_reference(rows, bags, None, grad.to(dtype)),
            strict=True,
        ):
            same_bits(got, want)
    empty = torch.zeros(0, dtype=torch.int64)
    u, g = dedupe_sorted(empty, empty, None, torch.zeros(0, 8))
    assert u.shape == (0,) and g.shape == (0, 8) and g.dtype == torch.float32


def test_dedupe_takes_ids_beyond_int32():
    rows = torch.tensor([2**33 + 5, 7, 2**33 + 5, 7, 0])
    bags = torch.arange(5)
    grad = torch.randn(5, 4)
    u, g = dedupe_sorted(rows, bags, None, grad)
    assert u.tolist() == [0, 7, 2**33 + 5]
    same_bits(g, dedupe_reference(rows, bags, None, grad)[1])


def test_dedupe_is_deterministic_across_thread_counts():
    rows, bags, grad = bag_batch(20000, 3000, 4000, 32, seed=5, hot=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dedupe_sorted(rows, bags, None, grad)[1]
        torch.set_num_threads(2)
        two = dedupe_sorted(rows, bags, None, grad)[1]
    finally:
        torch.set_num_threads(threads)
    same_bits(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 3, 32])
def test_copy_rows_and_apply_delta_write_the_rows_given(dtype, width):
    torch.manual_seed(width)
    weight = torch.randn(100, width).to(dtype)
    rows = torch.tensor([3, 97, 0, 41])
    src = torch.randn(4, width).to(dtype)
    want = weight.clone()
    want[rows] = src
    copy_rows(weight, rows, src)
    same_bits(weight, want)
    same_bits(gather_rows(weight, rows), src)
    delta = torch.randn(4, width)
    # the contract: index_add_ with alpha=-scale in fp32 (torch's add kernel, which may fuse
    # the multiply-add on CPUs with FMA), rounded once to the weight's dtype
    want = weight.float().index_add_(0, rows, delta, alpha=-0.3).to(dtype)
    apply_delta(weight, rows, delta, 0.3)
    same_bits(weight, want)


def test_rows_of_a_column_slice_fall_back_to_index_ops():
    weight = torch.zeros(10, 12)
    view = weight[:, 4:8]  # rows 48 bytes apart, not 16-byte words
    copy_rows(view, torch.tensor([1, 5]), torch.ones(2, 4))
    assert weight.sum() == 8 and weight[1, 4:8].eq(1).all() and weight[1, :4].eq(0).all()
    same_bits(gather_rows(view, torch.tensor([5, 0])), torch.tensor([[1.0] * 4, [0.0] * 4]))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("width", [1, 3, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row_stat", [False, True])
def test_update_equals_the_reference_bit_for_bit(name, width, dtype, row_stat):
    opt = OPTIMIZERS[name]()
    weight = torch.randn(300, width).to(dtype)
    state = random_state(opt, 300, width)
    w_ref, s_ref = weight.clone(), {k: v.clone() for k, v in state.items()}
    g = torch.Generator().manual_seed(width)
    for step in (1, 2, 3):
        rows = torch.randperm(300, generator=g)[:120].sort().values
        grads = torch.randn(120, width, generator=g)
        # a column shard's full-row mean(g^2), as the sharded collection passes it
        stat = torch.rand(120, generator=g) if row_stat else None
        opt.update(weight, state, rows, grads, step, stat)
        reference_update(opt, w_ref, s_ref, rows, grads, step, stat)
        same_bits(weight, w_ref)
        for k in state:
            same_bits(state[k], s_ref[k])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_group_backward_equals_the_reference_path(name):
    """FusedEmbedding's backward + update on two tables (repeated ids, mean pooling) equals the
    former dedupe followed by the former update, over several steps."""
    group, ref = two_table_groups(OPTIMIZERS[name])
    for step in (1, 2, 3):
        rows, bags, grad = bag_batch(900, 450, 200, 8, seed=step, hot=4)
        scale = torch.full((900,), 0.5)
        group.apply_gradient(rows, bags, scale, grad)
        u, g = dedupe_reference(rows, bags, scale, grad)
        reference_update(ref.optimizer, ref.weight, ref.state(), u, g, step)
        same_bits(group.weight, ref.weight)
        for k, v in group.state().items():
            same_bits(v, ref.state()[k])
