"""The Triton kernels (hybridrec.kernels) compiled on CUDA, against the torch path on
the same GPU, at a realistic size: a 1M-row fused table (26 tables), D = 128, 65536 * 26
Zipf(1.05) ids, so hot rows collect thousands of ids and take segment_grads' split path.

On CUDA `pool`, `dedupe` and the optimizers' `.update` dispatch to the kernels themselves, so
every torch reference runs inside `dispatch.use_kernels("torch")`.

Tolerances (the CPU interpreter tests in tests/unit/test_triton_ops.py explain the rounding):
- lookup: fp32 round-off (rtol 1e-5, atol 1e-6); CUDA's embedding_bag sums in another order.
- dedupe: torch's index_add_ sums with atomics in no fixed order, so both paths are checked
  against a float64 reference, within 1e-5 of each row's sum of |terms| (+1e-6), and the
  Triton result must be bit-identical from call to call.
- updates: optimizer state from identical elementwise ops exact (Adam's moments, row-wise
  Adagrad's sum given row_sq_mean; element-wise Adagrad's sums within 1 ulp, the kernel's
  one fma against CUDA's addcmul_); weights within 1 ulp of their dtype or 1e-6 (torch's CUDA
  index_add_ rounds lr * g before adding, the kernels use one fma).
- the padded, sync-free step (segment_grads_padded, updates with count=) runs under
  torch.cuda.set_sync_debug_mode("error") and equals the synced kernels bit for bit when both
  sum the same ids per tile (same chunks, same order, no atomics).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("triton")

from hybridrec.kernels import dispatch, lookup, row_update, segment  # noqa: E402
from hybridrec.kernels.lookup import pool  # noqa: E402
from hybridrec.kernels.segment import dedupe  # noqa: E402
from hybridrec.optim.sparse import (  # noqa: E402
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseSGD,
)

pytestmark = pytest.mark.gpu

ROWS, TABLES, DIM, BATCH = 1_000_000, 26, 128, 65536


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    """Compiled kernels, whatever the environment says (the interpreter is for CPU tests)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("HYBRIDREC_KERNELS", raising=False)


def _zipf_rows(hotness: int, seed: int = 0) -> torch.Tensor:
    """BATCH * hotness ids per table, Zipf(1.05) ranks scattered over each table's rows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_table = ROWS // TABLES
    u = torch.rand(TABLES, BATCH * hotness, device="cuda", generator=gen, dtype=torch.float64)
    a = 1.0 - 1.05
    rank = (((per_table + 1) ** a - 1.0) * u + 1.0) ** (1.0 / a)
    rank = (rank.floor().long() - 1).clamp_(0, per_table - 1)
    local = (rank * 2654435761 + 17) % per_table
    base = torch.arange(TABLES, device="cuda").unsqueeze(1) * per_table
    return (local + base).reshape(-1)


def _case(dtype: torch.dtype, hotness: int = 1, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight = (torch.randn(ROWS, DIM, device="cuda", generator=gen) * 0.05).to(dtype)
    rows = _zipf_rows(hotness, seed)
    num_bags = BATCH * TABLES
    bags = torch.arange(num_bags, device="cuda").repeat_interleave(hotness)
    offsets = torch.arange(num_bags + 1, device="cuda") * hotness
    return weight, rows, bags, offsets, num_bags, gen


@pytest.mark.parametrize("hotness", [1, 4])
@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pooled_lookup_on_gpu(dtype, with_scale, hotness):
    weight, rows, bags, offsets, num_bags, gen = _case(dtype, hotness)
    scale = torch.rand(rows.numel(), device="cuda", generator=gen) + 0.5 if with_scale else None
    got = lookup.pooled_lookup(weight, rows, offsets, scale, num_bags)
    want = torch.nn.functional.embedding_bag(
        rows, weight.float(), offsets[:-1], mode="sum", per_sample_weights=scale
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(pool(weight, rows, bags, scale, num_bags), got)  # pool takes the kernel
    with dispatch.use_kernels("torch"):
        want = pool(weight, rows, bags, scale, num_bags)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hotness", [1, 4])
def test_pooled_lookup_bf16_output_on_gpu(hotness):
    """bf16 output (DLRM under autocast): the fp32 sum rounded once, .to(bf16)'s bits."""
    weight, rows, _, offsets, num_bags, _ = _case(torch.float32, hotness)
    full = lookup.pooled_lookup(weight, rows, offsets, None, num_bags)
    half = lookup.pooled_lookup(weight, rows, offsets, None, num_bags, torch.bfloat16)
    assert torch.equal(half.view(torch.int16), full.to(torch.bfloat16).view(torch.int16))


def _dedupe64(rows, bags, scale, grad, absolute=False):
    """dedupe in float64 (of |terms| with absolute=True): (unique rows, sums)."""
    terms = grad.double().index_select(0, bags)
    if scale is not None:
        terms = terms * scale.double().unsqueeze(1)
    if absolute:
        terms = terms.abs()
    unique_rows, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    sums = torch.zeros(unique_rows.numel(), grad.shape[1], dtype=torch.float64, device=grad.device)
    return unique_rows, sums.index_add_(0, inverse, terms)


def _check_against_fp64(got, rows, bags, scale, grad) -> None:
    ref_rows, ref = _dedupe64(rows, bags, scale, grad)
    bound = _dedupe64(rows, bags, scale, grad, absolute=True)[1]
    got_rows, got_grads = got
    assert torch.equal(got_rows, ref_rows)
    err = (got_grads.double() - ref).abs()
    assert bool((err <= 1e-5 * bound + 1e-6).all()), f"max error {err.max().item():.3g}"


@pytest.mark.parametrize("hotness", [1, 4])
@pytest.mark.parametrize("with_scale", [False, True])
def test_segment_grads_on_gpu(with_scale, hotness):
    _, rows, bags, _, num_bags, gen = _case(torch.float32, hotness, seed=1)
    scale = torch.rand(rows.numel(), device="cuda", generator=gen) if with_scale else None
    grad = torch.randn(num_bags, DIM, device="cuda", generator=gen)
    got = segment.segment_grads(grad, rows, bags, scale)
    counts = torch.unique(rows, return_counts=True)[1]
    assert counts.max() > 4 * segment.SEGMENT_TILE  # rows across tiles: the fix-up ran
    _check_against_fp64(got, rows, bags, scale, grad)
    with dispatch.use_kernels("torch"):
        want = dedupe(rows, bags, scale, grad)
    _check_against_fp64(want, rows, bags, scale, grad)
    again = segment.segment_grads(grad, rows, bags, scale)
    assert torch.equal(got[0], again[0]) and torch.equal(got[1], again[1])


def test_segment_grads_one_row_for_every_id():
    """All 1.7M ids on one row: tens of thousands of tile pieces added by one program."""
    n = BATCH * TABLES
    rows = torch.full((n,), 12345, device="cuda")
    bags = torch.arange(n, device="cuda")
    grad = torch.randn(n, DIM, device="cuda")
    _check_against_fp64(segment.segment_grads(grad, rows, bags, None), rows, bags, None, grad)


def _touched(seed: int = 2):
    rows = torch.unique(_zipf_rows(1, seed))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    grads = torch.randn(rows.numel(), DIM, device="cuda", generator=gen)
    return rows, grads, gen


def _assert_weights_close(got: torch.Tensor, want: torch.Tensor) -> None:
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgd_update_on_gpu(dtype):
    weight = _case(dtype)[0]
    rows, grads, _ = _touched()
    want = weight.clone()
    with dispatch.use_kernels("torch"):
        SparseSGD(0.05).update(want, {}, rows, grads, 1)
    row_update.update(SparseSGD(0.05), weight, {}, rows, grads, 1)
    _assert_weights_close(weight, want)


@pytest.mark.parametrize("given_row_sq", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_adagrad_update_on_gpu(dtype, given_row_sq):
    weight = _case(dtype)[0]
    rows, grads, gen = _touched()
    acc = torch.rand(ROWS, device="cuda", generator=gen)
    row_sq = torch.rand(rows.numel(), device="cuda", generator=gen) if given_row_sq else None
    want, want_acc = weight.clone(), acc.clone()
    for _ in range(2):
        with dispatch.use_kernels("torch"):
            RowWiseAdagrad(0.05, 1e-8).update(want, {"sum": want_acc}, rows, grads, 1, row_sq)
        row_update.update(RowWiseAdagrad(0.05, 1e-8), weight, {"sum": acc}, rows, grads, 1, row_sq)
    if given_row_sq:
        assert torch.equal(acc, want_acc)
    else:
        torch.testing.assert_close(acc, want_acc, rtol=1e-6, atol=0)
    _assert_weights_close(weight, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adagrad_update_on_gpu(dtype):
    """Element-wise Adagrad: the kernel against SparseAdagrad's torch ops on the same GPU."""
    weight = _case(dtype)[0]
    rows, grads, gen = _touched()
    acc = torch.rand(ROWS, DIM, device="cuda", generator=gen) * 0.01
    want, want_acc = weight.clone(), acc.clone()
    for _ in range(2):
        with dispatch.use_kernels("torch"):
            SparseAdagrad(0.05, 1e-8).update(want, {"sum": want_acc}, rows, grads, 1)
        row_update.update(SparseAdagrad(0.05, 1e-8), weight, {"sum": acc}, rows, grads, 1)
    # s + g * g: one fma in the kernel, as torch's addcmul_ on CPU; CUDA's may round twice
    torch.testing.assert_close(acc, want_acc, rtol=2e-7, atol=0)
    _assert_weights_close(weight, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_update_on_gpu(dtype):
    weight = _case(dtype)[0]
    rows, grads, gen = _touched()
    m = torch.randn(ROWS, DIM, device="cuda", generator=gen) * 0.01
    v = torch.rand(ROWS, DIM, device="cuda", generator=gen) * 0.01
    want, want_m, want_v = weight.clone(), m.clone(), v.clone()
    opt = SparseAdam(0.001)
    for step in (1, 2, 3):
        with dispatch.use_kernels("torch"):
            opt.update(want, {"exp_avg": want_m, "exp_avg_sq": want_v}, rows, grads, step)
        row_update.update(opt, weight, {"exp_avg": m, "exp_avg_sq": v}, rows, grads, step)
    assert torch.equal(m, want_m) and torch.equal(v, want_v)
    _assert_weights_close(weight, want)


@contextlib.contextmanager
def _no_host_sync():
    """Raise on any operation that waits for the device (set_sync_debug_mode("error"))."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_sync_debug_mode_catches_a_sync():
    """The check below is live: a sync in the region raises."""
    with pytest.raises(RuntimeError), _no_host_sync():
        torch.ones(1, device="cuda").item()


@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad", "adam", "adagrad"])
def test_padded_step_without_host_sync(opt):
    """segment_grads_padded + update(count=) never waits for the device, and equals
    segment_grads + update (bit-identical) on Zipf ids with hot rows."""
    weight, rows, bags, _, num_bags, gen = _case(torch.bfloat16, hotness=4, seed=3)
    scale = torch.rand(rows.numel(), device="cuda", generator=gen)
    grad = torch.randn(num_bags, DIM, device="cuda", generator=gen)
    state = {
        "sgd": [],
        "rowwise_adagrad": [torch.rand(ROWS, device="cuda", generator=gen)],
        "adagrad": [torch.rand(ROWS, DIM, device="cuda", generator=gen)],
        "adam": [
            torch.randn(ROWS, DIM, device="cuda", generator=gen) * 0.01,
            torch.rand(ROWS, DIM, device="cuda", generator=gen) * 0.01,
        ],
    }[opt]

    optimizer = {
        "sgd": SparseSGD(0.05),
        "rowwise_adagrad": RowWiseAdagrad(0.05, 1e-8),
        "adagrad": SparseAdagrad(0.05, 1e-8),
        "adam": SparseAdam(1e-3, 0.9, 0.999, 1e-8),
    }[opt]

    def update(tensors, urows, grads, count):
        w, *st = tensors
        state = dict(zip(optimizer.state_spec(), st, strict=True))
        row_update.update(optimizer, w, state, urows, grads, 1, count=count)

    def padded_step(tensors):
        urows, grads, count = segment.segment_grads_padded(grad, rows, bags, scale)
        update(tensors, urows, grads, count)
        return urows, grads, count

    want = [t.clone() for t in (weight, *state)]
    want_rows, want_grads = segment.segment_grads(grad, rows, bags, scale)
    update(want, want_rows, want_grads, None)
    padded_step([t.clone() for t in (weight, *state)])  # compile the kernels first
    got = [t.clone() for t in (weight, *state)]
    torch.cuda.synchronize()
    with _no_host_sync():
        got_rows, got_grads, count = padded_step(got)
    u = int(count)
    assert u == want_rows.numel() and u < rows.numel()
    assert torch.equal(got_rows[:u], want_rows) and torch.equal(got_grads[:u], want_grads)
    _check_against_fp64((got_rows[:u], got_grads[:u]), rows, bags, scale, grad)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
