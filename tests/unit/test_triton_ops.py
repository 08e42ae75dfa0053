"""Triton kernels (hybridrec.kernels) against the torch path, on CPU through Triton's
interpreter (TRITON_INTERPRET=1); tests/gpu/test_triton_gpu.py runs them compiled on CUDA.

References are the torch functions the kernels replace, called on copies of the same inputs:
`pool` / F.embedding_bag, `dedupe`, and the optimizers' `.update` (SparseSGD, SparseAdagrad,
RowWiseAdagrad, SparseAdam), whose kernels are `row_update.update`, the one launcher, with the
optimizer's maths. Under the interpreter `.update` dispatches to the kernels themselves
(`dispatch.available`), so every reference runs inside `dispatch.use_kernels("torch")`
(`_torch_ops`): a reference that ran the kernel would compare the kernel with itself. Tolerances:
- SGD: at most 1 ulp of the weight dtype. The kernels round like torch's CPU ops (fp32 math,
  one fused multiply-add for w - lr * g as torch's index_add_/sub_ with alpha, one rounding to
  the weight dtype): bit-identical here; the 1 ulp allows for a torch build that does not fuse.
- optimizer state from identical elementwise ops (Adam's moments, element-wise Adagrad's sum,
  row-wise Adagrad's sum when row_sq_mean is given): exact.
- Adagrad and Adam weights: rtol = eps of the weight dtype (1 ulp), atol 1e-6. The kernels
  take IEEE sqrt (sqrt_rn, as CUDA's sqrtf); torch's vectorized CPU sqrt is not always
  correctly rounded (about 0.5% of fp32 inputs are 1 ulp off numpy's), so a step can differ
  by 1 ulp, and w - step can cancel (the 1e-6 absolute).
- sums whose order differs from torch's (pooling, dedupe, the row mean of g^2): fp32
  round-off, rtol 1e-5 / atol 1e-6 (a few ulps of sums of a few dozen terms).
- the padded, sync-free variant (segment_grads_padded, the updates' count=) against the synced
  kernels: exact (the same computation, cut to U rows).

The interpreter is chosen when a kernel is jitted, and hybridrec.kernels jits on first use per
mode (interpreted or compiled), so setting TRITON_INTERPRET here, before the first call, suffices:
no import order or module reload is needed. The module fixture restores the environment.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hybridrec.kernels import _common, dispatch, lookup, row_update, segment  # noqa: E402
from hybridrec.kernels.lookup import pool  # noqa: E402
from hybridrec.kernels.segment import dedupe  # noqa: E402
from hybridrec.optim.sparse import (  # noqa: E402
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseSGD,
)

# each optimizer with its state of a [ROWS, width] table (random, or zeros), by name
OPTIMIZERS = {
    "sgd": lambda lr: SparseSGD(lr),
    "rowwise_adagrad": lambda lr: RowWiseAdagrad(lr, 1e-8),
    "adam": lambda lr: SparseAdam(lr, 0.9, 0.999, 1e-8),
    "adagrad": lambda lr: SparseAdagrad(lr, 1e-8),
}


def _states(opt, width: int, g: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    return {
        name: torch.rand(kind.shape(ROWS, width), generator=g)
        if g is not None
        else torch.zeros(kind.shape(ROWS, width))
        for name, kind in opt.state_spec().items()
    }


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WIDTHS = [1, 3, 16, 130]  # 130: not a power of two, more than one column block
ROWS = 40


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.delenv("HYBRIDREC_KERNELS", raising=False)
        yield


def _torch_ops():
    """The block runs the torch ops, not the kernels (references; see the module docstring)."""
    return dispatch.use_kernels("torch")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in units in the last place of their (same) dtype."""
    assert a.dtype == b.dtype and a.shape == b.shape
    int_type = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    ia, ib = (x.contiguous().view(int_type[x.dtype]).long() for x in (a, b))
    sign = 1 << (8 * a.element_size() - 1)
    ma = torch.where(ia < 0, -(ia + sign), ia)  # sign-magnitude -> monotonic integers
    mb = torch.where(ib < 0, -(ib + sign), ib)
    return int((ma - mb).abs().max()) if a.numel() else 0


def _assert_step_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Weights after a step with a square root: 1 ulp of their dtype, or 1e-6 (see above)."""
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=1e-6)


def _bags(counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """bags [N] (non-decreasing) and offsets [B + 1] for bags of the given sizes."""
    c = torch.tensor(counts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), c.cumsum(0)])
    return torch.repeat_interleave(torch.arange(len(counts)), c), offsets


# bag sizes: empty bags (first, middle, last), single ids, a long bag
COUNTS = [0, 2, 1, 0, 7, 3, 1, 12, 0, 4, 0]


def _lookup_case(width: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(ROWS, width, generator=g).to(dtype)
    bags, offsets = _bags(COUNTS)
    rows = torch.randint(0, 8, (bags.numel(),), generator=g)  # 8 of 40 rows: many repeats
    scale = torch.rand(bags.numel(), generator=g) + 0.5
    return weight, rows, bags, offsets, scale


@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_pooled_lookup_matches_torch(width, dtype, with_scale):
    weight, rows, bags, offsets, scale = _lookup_case(width, dtype)
    scale = scale if with_scale else None
    got = lookup.pooled_lookup(weight, rows, offsets, scale, len(COUNTS))
    assert got.dtype == torch.float32 and got.shape == (len(COUNTS), width)
    want = torch.nn.functional.embedding_bag(
        rows, weight.float(), offsets[:-1], mode="sum", per_sample_weights=scale
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(pool(weight, rows, bags, scale, len(COUNTS)), got)  # pool takes the kernel
    with _torch_ops():
        want = pool(weight, rows, bags, scale, len(COUNTS))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    empty = [b for b, c in enumerate(COUNTS) if c == 0]
    assert torch.equal(got[empty], torch.zeros(len(empty), width))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", WIDTHS)
def test_pooled_lookup_rounds_once_to_out_dtype(width, out_dtype):
    """A bf16/fp16 output is the fp32 sum rounded once to nearest even: .to()'s bits."""
    weight, rows, _, offsets, scale = _lookup_case(width, torch.float32)
    full = lookup.pooled_lookup(weight, rows, offsets, scale, len(COUNTS))
    half = lookup.pooled_lookup(weight, rows, offsets, scale, len(COUNTS), out_dtype)
    assert half.dtype == out_dtype
    assert torch.equal(half.view(torch.int16), full.to(out_dtype).view(torch.int16))


def test_pooled_lookup_no_ids_and_no_bags():
    weight = torch.randn(5, 4)
    none = torch.zeros(0, dtype=torch.int64)
    out = lookup.pooled_lookup(weight, none, torch.zeros(4, dtype=torch.int64), None, 3)
    assert torch.equal(out, torch.zeros(3, 4))
    empty = lookup.pooled_lookup(weight, none, torch.zeros(1, dtype=torch.int64), None, 0)
    assert empty.shape == (0, 4)


@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("width", WIDTHS)
def test_segment_grads_match_dedupe(width, with_scale):
    _, rows, bags, _, scale = _lookup_case(width, torch.float32, seed=1)
    scale = scale if with_scale else None
    grad = torch.randn(len(COUNTS), width, generator=torch.Generator().manual_seed(2))
    with _torch_ops():
        want_rows, want = dedupe(rows, bags, scale, grad)
    got_rows, got = segment.segment_grads(grad, rows, bags, scale)
    assert torch.equal(got_rows, want_rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tile", [1, 2, 4, 32])
def test_segment_grads_split_hot_rows(tile):
    """Rows whose ids cross tiles are summed in pieces, then added in tile order: same
    result (tile 1: every row of more than one id is split; 4: pieces begin and end mid-tile,
    and a piece spans whole tiles)."""
    g = torch.Generator().manual_seed(3)
    bags, _ = _bags([3, 0, 9, 5, 1, 6])
    rows = torch.tensor([7, 7, 7, 2, 7, 7, 7, 7, 7, 7, 2, 2, 7, 7, 0, 7, 7, 7, 2, 7, 7, 9, 7, 7])
    assert rows.numel() == bags.numel()
    scale = torch.rand(rows.numel(), generator=g)
    grad = torch.randn(6, 130, generator=g)
    with _torch_ops():
        want_rows, want = dedupe(rows, bags, scale, grad)
    got_rows, got = segment._segment_grads(grad, rows, bags, scale, tile)
    assert torch.equal(got_rows, want_rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # deterministic: no atomics, a fixed summation order
    again = segment._segment_grads(grad, rows, bags, scale, tile)[1]
    assert torch.equal(got, again)


def test_segment_grads_low_precision_grad_and_no_ids():
    _, rows, bags, _, scale = _lookup_case(16, torch.float32, seed=4)
    grad = torch.randn(len(COUNTS), 16).bfloat16()
    with _torch_ops():
        want_rows, want = dedupe(rows, bags, scale, grad)
    got_rows, got = segment.segment_grads(grad, rows, bags, scale)
    assert torch.equal(got_rows, want_rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    none = torch.zeros(0, dtype=torch.int64)
    u, g = segment.segment_grads(grad, none, none, None)
    assert u.numel() == 0 and g.shape == (0, 16)


def _update_case(width: int, dtype: torch.dtype, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(ROWS, width, generator=g).to(dtype)
    rows = torch.randperm(ROWS, generator=g)[:11].sort().values
    grads = torch.randn(rows.numel(), width, generator=g)
    return weight, rows, grads, g


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_sgd_update_matches_sparse_sgd(width, dtype):
    weight, rows, grads, _ = _update_case(width, dtype)
    want = weight.clone()
    with _torch_ops():
        SparseSGD(0.05).update(want, {}, rows, grads, 1)
    row_update.update(SparseSGD(0.05), weight, {}, rows, grads, 1)
    assert _ulps(weight, want) <= 1


@pytest.mark.parametrize("given_row_sq", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_rowwise_adagrad_update_matches(width, dtype, given_row_sq):
    weight, rows, grads, g = _update_case(width, dtype)
    acc = torch.rand(ROWS, generator=g)
    row_sq = torch.rand(rows.numel(), generator=g) if given_row_sq else None
    want, want_acc = weight.clone(), acc.clone()
    for _ in range(2):  # the second step reads the first one's state
        with _torch_ops():
            RowWiseAdagrad(0.05, 1e-8).update(want, {"sum": want_acc}, rows, grads, 1, row_sq)
        row_update.update(RowWiseAdagrad(0.05, 1e-8), weight, {"sum": acc}, rows, grads, 1, row_sq)
    if given_row_sq:
        assert torch.equal(acc, want_acc)
    else:  # mean(g^2) sums in a different order than torch's mean: round-off in acc
        torch.testing.assert_close(acc, want_acc, rtol=1e-6, atol=0)
    _assert_step_close(weight, want)
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(acc[untouched], want_acc[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_adagrad_update_matches_sparse_adagrad(width, dtype):
    weight, rows, grads, g = _update_case(width, dtype)
    acc = torch.rand(ROWS, width, generator=g)
    want, want_acc = weight.clone(), acc.clone()
    for _ in range(2):  # the second step reads the first one's state
        row_update.update(SparseAdagrad(0.05, 1e-8), weight, {"sum": acc}, rows, grads, 1)
        with _torch_ops():
            SparseAdagrad(0.05, 1e-8).update(want, {"sum": want_acc}, rows, grads, 1)
    assert torch.equal(acc, want_acc)  # untouched rows included
    _assert_step_close(weight, want)
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(weight[untouched], want[untouched])


def test_sparse_adagrad_update_runs_the_kernel():
    """Under the interpreter SparseAdagrad.update dispatches to the kernel (same bits)."""
    weight, rows, grads, g = _update_case(16, torch.float32)
    acc = torch.rand(ROWS, 16, generator=g)
    want, want_acc = weight.clone(), acc.clone()
    SparseAdagrad(0.05, 1e-8).update(weight, {"sum": acc}, rows, grads, 1)
    row_update.update(SparseAdagrad(0.05, 1e-8), want, {"sum": want_acc}, rows, grads, 1)
    assert torch.equal(weight, want) and torch.equal(acc, want_acc)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_adam_update_matches_sparse_adam(width, dtype):
    weight, rows, grads, g = _update_case(width, dtype)
    m, v = torch.randn(ROWS, width, generator=g), torch.rand(ROWS, width, generator=g)
    want, want_m, want_v = weight.clone(), m.clone(), v.clone()
    opt = SparseAdam(0.01, 0.9, 0.999, 1e-8)
    for step in (1, 2):
        with _torch_ops():
            opt.update(want, {"exp_avg": want_m, "exp_avg_sq": want_v}, rows, grads, step)
        row_update.update(opt, weight, {"exp_avg": m, "exp_avg_sq": v}, rows, grads, step)
    assert torch.equal(m, want_m) and torch.equal(v, want_v)
    _assert_step_close(weight, want)


# --- the padded, sync-free variant: segment_grads_padded and the updates' count= ---------------


def _padded_case(kind: str, width: int = 130, seed: int = 6):
    """(grad, rows, bags, scale) with rows: duplicates and empty bags, rows longer than a
    tile of 4 (hot), all distinct, or all the same row."""
    g = torch.Generator().manual_seed(seed)
    if kind == "duplicates":
        bags, _ = _bags(COUNTS)
        rows = torch.randint(0, 8, (bags.numel(),), generator=g)
    else:
        bags, _ = _bags([3, 0, 9, 5, 1, 6])
        n = bags.numel()
        rows = {
            "hot": torch.tensor(
                [7, 7, 7, 2, 7, 7, 7, 7, 7, 7, 2, 2, 7, 7, 0, 7, 7, 7, 2, 7, 7, 9, 7, 7]
            ),
            "distinct": torch.randperm(ROWS, generator=g)[:n],
            "same": torch.full((n,), 5),
        }[kind]
    scale = torch.rand(rows.numel(), generator=g) + 0.5
    grad = torch.randn(int(bags.max()) + 1, width, generator=g)
    return grad, rows, bags, scale


@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("kind", ["duplicates", "hot", "distinct", "same"])
@pytest.mark.parametrize("tile", [4, 32])
def test_segment_grads_padded_equals_segment_grads(tile, kind, with_scale):
    """The first count entries are segment_grads': rows exactly, grads bit-identical for the
    same tile, and within fp32 round-off of the torch dedupe."""
    grad, rows, bags, scale = _padded_case(kind)
    scale = scale if with_scale else None
    n = rows.numel()
    want_rows, want = segment._segment_grads(grad, rows, bags, scale, tile)
    got_rows, got, count = segment._segment_grads_padded(grad, rows, bags, scale, tile)
    assert count.shape == (1,) and count.dtype == torch.int64
    u = int(count)
    assert u == want_rows.numel()
    assert got_rows.shape == (n,) and got.shape == (n, grad.shape[1])
    assert torch.equal(got_rows[:u], want_rows)
    assert torch.equal(got[:u], want)
    again = segment._segment_grads_padded(grad, rows, bags, scale, tile)
    assert torch.equal(again[1][:u], got[:u])  # deterministic
    got_rows, got, count = segment.segment_grads_padded(grad, rows, bags, scale)
    assert int(count) == u and torch.equal(got_rows[:u], want_rows)
    torch.testing.assert_close(got[:u], want, rtol=1e-5, atol=1e-6)
    with _torch_ops():
        _, want = dedupe(rows, bags, scale, grad)
    torch.testing.assert_close(got[:u], want, rtol=1e-5, atol=1e-6)


def test_segment_grads_padded_no_ids_and_no_width():
    none = torch.zeros(0, dtype=torch.int64)
    rows, grads, count = segment.segment_grads_padded(torch.randn(3, 4), none, none, None)
    assert rows.shape == (0,) and grads.shape == (0, 4) and torch.equal(count, torch.tensor([0]))
    rows = torch.tensor([4, 1, 4])
    got_rows, grads, count = segment.segment_grads_padded(torch.zeros(3, 0), rows, rows, None)
    assert int(count) == 2 and torch.equal(got_rows[:2], torch.tensor([1, 4]))
    assert grads.shape == (3, 0)


def _pad(rows: torch.Tensor, grads: torch.Tensor, *extra: torch.Tensor):
    """rows, grads and extra [U] vectors padded with garbage: rows not in `rows` and a repeat
    of rows[0], NaN grads and values; count [1] = U."""
    spare = torch.ones(ROWS, dtype=torch.bool)
    spare[rows] = False
    junk = torch.cat([spare.nonzero()[:3, 0], rows[:1]])
    nan = float("nan")
    padded = [torch.cat([rows, junk]), torch.cat([grads, torch.full((4, grads.shape[1]), nan)])]
    padded += [torch.cat([t, torch.full((4,), nan)]) for t in extra]
    return *padded, torch.tensor([rows.numel()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [3, 130])
def test_padded_updates_equal_unpadded(width, dtype):
    """count= updates the first count rows exactly as the unpadded call, and nothing else."""
    weight, rows, grads, g = _update_case(width, dtype)
    row_sq = torch.rand(rows.numel(), generator=g)
    p_rows, p_grads, p_row_sq, count = _pad(rows, grads, row_sq)
    opts = [make(0.05) for make in OPTIMIZERS.values()]
    states = [_states(opt, width, g) for opt in opts]
    want = (weight.clone(), [{k: v.clone() for k, v in st.items()} for st in states])
    got = (weight, states)
    for (w, sts), (r, gr, rsq, c) in (
        (want, (rows, grads, row_sq, None)),
        (got, (p_rows, p_grads, p_row_sq, count)),
    ):
        for step, (opt, st) in enumerate(zip(opts, sts, strict=True), 1):
            row_update.update(opt, w, st, r, gr, step, count=c)
            if opt.needs_full_row_stat:  # with a given full-row statistic too
                row_update.update(opt, w, st, r, gr, step, rsq, count=c)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_padded_updates_with_count_zero():
    weight, rows, grads, g = _update_case(3, torch.float32)
    zero, none = torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    for make in OPTIMIZERS.values():
        opt = make(0.1)
        state = _states(opt, 3, g)
        before = [t.clone() for t in (weight, *state.values())]
        for r, gr in ((rows, grads), (none, torch.zeros(0, 3))):
            row_update.update(opt, weight, state, r, gr, 1, count=zero)
        for a, b in zip((weight, *state.values()), before, strict=True):
            assert torch.equal(a, b), opt.name


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_padded_step_equals_synced_step(opt):
    """segment_grads_padded -> update(count=) with its padding left as is (uninitialised
    grads) equals segment_grads -> update."""
    grad, rows, bags, scale = _padded_case("hot", width=16)
    optimizer = OPTIMIZERS[opt](0.05)
    weight = torch.randn(ROWS, 16)
    state = _states(optimizer, 16, torch.Generator().manual_seed(1))
    tensors = [(weight.clone(), {k: v.clone() for k, v in state.items()}) for _ in range(2)]
    synced = segment._segment_grads(grad, rows, bags, scale, 4)
    padded = segment._segment_grads_padded(grad, rows, bags, scale, 4)
    for (w, st), (r, gr, *c) in zip(tensors, (synced, padded), strict=True):
        row_update.update(optimizer, w, st, r, gr, 1, count=c[0] if c else None)
    (w_a, st_a), (w_b, st_b) = tensors
    assert torch.equal(w_a, w_b)
    for k in st_a:
        assert torch.equal(st_a[k], st_b[k]), k


def test_bf16_rounds_to_nearest_even():
    """bf16 weights are rounded by hand in the kernels (the interpreter's cast truncates):
    ties go to even, and values just above/below a tie go to the nearest."""
    weight = torch.ones(1, 4, dtype=torch.bfloat16)
    # 1 + k * 2^-9 around the tie between 1 and 1 + 2^-7 (bf16's ulp at 1)
    grads = -torch.tensor([[1.0, 2.0, 3.0, 2.0 + 2**-12]]) * 2**-9
    row_update.update(SparseSGD(1.0), weight, {}, torch.tensor([0]), grads, 1)
    want = (torch.ones(1, 4) - grads).bfloat16()
    assert torch.equal(weight, want)


def test_updates_with_no_rows_do_nothing():
    weight = torch.randn(ROWS, 3)
    before = weight.clone()
    none, no_grads = torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3)
    for make in OPTIMIZERS.values():
        opt = make(0.1)
        state = _states(opt, 3, torch.Generator().manual_seed(0))
        saved = {k: v.clone() for k, v in state.items()}
        row_update.update(opt, weight, state, none, no_grads, 1)
        assert all(torch.equal(state[k], saved[k]) for k in state), opt.name
    assert torch.equal(weight, before)


def test_available_follows_environment(monkeypatch):
    t = torch.zeros(1)
    assert dispatch.available(t)
    with _torch_ops():  # the references' block
        assert not dispatch.available(t)
    assert dispatch.available(t)
    monkeypatch.setenv("HYBRIDREC_KERNELS", "torch")
    assert not dispatch.available(t)
    monkeypatch.delenv("HYBRIDREC_KERNELS")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not dispatch.available(t)  # CPU tensors need the interpreter
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        row_update.update(
            SparseSGD(0.1), torch.zeros(2, 2), {}, torch.tensor([0]), torch.zeros(1, 2), 1
        )


def test_kernels_are_jitted_per_mode():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(_common.jitted(lookup._pool_kernel), InterpretedFunction)


def _bad(match: str, fn, *args) -> None:
    with pytest.raises(ValueError, match=match):
        fn(*args)


def test_bad_inputs_raise_clear_errors():
    w, rows, offsets = torch.randn(10, 4), torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3])
    grads, acc = torch.zeros(3, 4), torch.zeros(10)
    pooled = lookup.pooled_lookup
    _bad("weight must be \\[R, D\\] fp32/bf16/fp16", pooled, w.double(), rows, offsets, None, 2)
    _bad("weight must be \\[R, D\\]", pooled, torch.randn(10), rows, offsets, None, 2)
    _bad("weight must be contiguous", pooled, w.t(), rows, offsets, None, 2)
    _bad("rows must be a 1-d int64", pooled, w, rows.int(), offsets, None, 2)
    _bad("offsets must have 3 entries", pooled, w, rows, offsets[:2], None, 2)
    _bad("scale must be \\[3\\] fp32", pooled, w, rows, offsets, torch.ones(2), 2)
    _bad("scale must be \\[3\\] fp32", pooled, w, rows, offsets, torch.ones(3).double(), 2)
    _bad("num_bags must be >= 0", pooled, w, rows, offsets, None, -1)

    seg = segment.segment_grads
    _bad("grad_pooled must be \\[B, D\\]", seg, torch.zeros(2, 4).long(), rows, rows, None)
    _bad("bags must have 3 entries", seg, torch.zeros(2, 4), rows, rows[:2], None)
    _bad("bags must be a 1-d int64", seg, torch.zeros(2, 4), rows, rows.float(), None)
    pad = segment.segment_grads_padded
    _bad("grad_pooled must be \\[B, D\\]", pad, torch.zeros(2, 4).long(), rows, rows, None)
    _bad("bags must have 3 entries", pad, torch.zeros(2, 4), rows, rows[:2], None)
    _bad("scale must be \\[3\\] fp32", pad, torch.zeros(2, 4), rows, rows, torch.ones(2))
    bad_counts = (torch.tensor([3], dtype=torch.int32), torch.tensor([3, 3]))
    for make in OPTIMIZERS.values():
        opt = make(0.1)
        state = {k: torch.zeros(kind.shape(10, 4)) for k, kind in opt.state_spec().items()}
        for count in bad_counts:
            with pytest.raises(ValueError, match="count must be a \\[1\\] int64 tensor"):
                row_update.update(opt, w, state, rows, grads, 1, count=count)

    upd = row_update.update
    sgd, ada = SparseSGD(0.1), RowWiseAdagrad(0.1, 1e-8)
    _bad("grads must be \\[3, 4\\] fp32", upd, sgd, w, {}, rows, grads[:2], 1)
    _bad("grads must be \\[3, 4\\] fp32", upd, sgd, w, {}, rows, grads.double(), 1)
    _bad("sgd keeps state \\[\\], got \\['sum'\\]", upd, sgd, w, {"sum": acc}, rows, grads, 1)
    _bad("sum must be \\[10\\] fp32", upd, ada, w, {"sum": acc[:5]}, rows, grads, 1)
    _bad("row_sq_mean must be \\[3\\] fp32", upd, ada, w, {"sum": acc}, rows, grads, 1, acc)
    ew = SparseAdagrad(0.1, 1e-8)
    _bad("sum must be \\[10, 4\\] fp32 like weight", upd, ew, w, {"sum": acc}, rows, grads, 1)
    _bad("sum must be contiguous", upd, ew, w, {"sum": torch.zeros(4, 10).t()}, rows, grads, 1)
    adam, m = SparseAdam(0.1, 0.9, 0.99, 1e-8), torch.zeros(10, 4)
    both = {"exp_avg": m[:5], "exp_avg_sq": m}
    _bad("exp_avg must be \\[10, 4\\] fp32", upd, adam, w, both, rows, grads, 1)
    both = {"exp_avg": m, "exp_avg_sq": m.t().contiguous().t()}
    _bad("exp_avg_sq must be contiguous", upd, adam, w, both, rows, grads, 1)


def test_fma32_rounds_once():
    """_common._fma32 (tl.fma for Triton interpreters before 3.9, which round x * y first)
    rounds x * y + z once: where the fp64 sum lands exactly halfway between two fp32 values,
    the exact value decides (a plain fp64 sum would round to even)."""
    import numpy as np

    one = 1 + 2**-12  # one * one = 1 + 2^-11 + 2^-24: halfway between two fp32 values
    x = np.array([one, one, -one, 1.5, 3.0], dtype=np.float32)
    y = np.array([one, one, one, 2.0, float("inf")], dtype=np.float32)
    z = np.array([2**-80, -(2**-80), -(2**-80), 0.25, 1.0], dtype=np.float32)
    want = [1 + 2**-11 + 2**-23, 1 + 2**-11, -(1 + 2**-11 + 2**-23), 3.25, float("inf")]
    assert _common._fma32(x, y, z).tolist() == want
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(10_000, generator=g) for _ in range(3))
    got = torch.from_numpy(_common._fma32(a.numpy(), b.numpy(), c.numpy()))
    assert torch.equal(got, torch.addcmul(c.double(), a.double(), b.double()).float())
