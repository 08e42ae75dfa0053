"""Sparse Adam's two eps forms, on every backend (torch ops, the C kernel, Triton under its CPU
interpreter), against the torch optimizers they claim to be.

- `eps_form="adam"`: eps added to the bias-corrected sqrt(v_hat), as
  torch.optim.Adam and FBGEMM (TorchRec) do.
- `eps_form="sparse_adam"` (the default): eps added to the raw sqrt(v), as torch.optim.SparseAdam
  does.

Every step touches every row, so lazy Adam is dense Adam and torch.optim.Adam is an exact
reference. eps = 1e-3 makes the forms differ by far more than the tolerance (float32
round-off), so each comparison can tell them apart: checked too.
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.config import SparseOptimConfig
from hybridrec.kernels import dispatch, native
from hybridrec.kernels.decay import decay_of
from hybridrec.kernels.rows import BACKENDS
from hybridrec.optim import SparseAdam, build_sparse_optimizer

ROWS, WIDTH, STEPS, LR, EPS, BETAS = 6, 5, 6, 0.05, 1e-3, (0.9, 0.99)


def _backend_params() -> list:
    params = [pytest.param("torch", id="torch")]
    skip_native = pytest.mark.skipif(native.lib() is None, reason="no C compiler")
    params.append(pytest.param("native", id="native", marks=skip_native))
    params.append(pytest.param("triton", id="triton"))
    return params


def _train(backend: str, eps_form: str, monkeypatch) -> tuple[torch.Tensor, dict]:
    """Weights and moments after STEPS updates of every row through one backend."""
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    opt = SparseAdam(LR, *BETAS, EPS, eps_form=eps_form)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(ROWS, WIDTH, generator=g)
    state = {"exp_avg": torch.zeros(ROWS, WIDTH), "exp_avg_sq": torch.zeros(ROWS, WIDTH)}
    rows = torch.arange(ROWS)
    with dispatch.use_kernels("triton" if backend == "triton" else "torch"):
        for step in range(1, STEPS + 1):
            # small gradients: sqrt(v_hat) is near eps, where the forms differ
            grads = torch.randn(ROWS, WIDTH, generator=g) * 1e-3
            BACKENDS[backend](opt, weight, state, rows, grads, step, None, None, decay_of(opt))
    return weight, state


def _torch_reference(optimizer: str) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(ROWS, WIDTH, generator=g))
    if optimizer == "adam":
        opt = torch.optim.Adam([p], lr=LR, betas=BETAS, eps=EPS)
    else:
        opt = torch.optim.SparseAdam([p], lr=LR, betas=BETAS, eps=EPS)
    for _ in range(STEPS):
        grads = torch.randn(ROWS, WIDTH, generator=g) * 1e-3
        p.grad = grads if optimizer == "adam" else grads.to_sparse()
        opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.parametrize("backend", _backend_params())
@pytest.mark.parametrize(
    "eps_form, twin, other", [("adam", "adam", "sparse_adam"), ("sparse_adam", "sparse", "adam")]
)
def test_each_eps_form_is_its_torch_optimizer_on_every_backend(
    backend, eps_form, twin, other, monkeypatch
):
    weight, state = _train(backend, eps_form, monkeypatch)
    want, want_state = _torch_reference(twin)
    torch.testing.assert_close(weight, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["exp_avg"], want_state["exp_avg"], rtol=1e-6, atol=1e-9)
    got_v, want_v = state["exp_avg_sq"], want_state["exp_avg_sq"]
    torch.testing.assert_close(got_v, want_v.to_dense(), rtol=1e-6, atol=1e-12)
    # the other form is a different optimizer here: the comparison above can fail
    elsewhere, _ = _torch_reference("sparse" if other == "sparse_adam" else "adam")
    assert (weight - elsewhere).abs().max() > 1e-3


def test_the_default_is_sparse_adams_form_and_the_config_reaches_both():
    assert SparseAdam(0.01).eps_form == "sparse_adam"
    assert build_sparse_optimizer(SparseOptimConfig(name="adam")).eps_form == "sparse_adam"
    opt = build_sparse_optimizer(SparseOptimConfig(name="adam", eps_form="adam"))
    assert opt.eps_form == "adam" and opt.step_eps(3) < opt.eps
    assert SparseAdam(0.01).step_eps(3) == SparseAdam(0.01).eps
    # torch.optim.Adam's form folds its bias correction of sqrt(v) into the eps the maths add
    assert SparseAdam(0.01, 0.9, 0.99, 1e-3, eps_form="adam").step_eps(1) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="eps_form must be one of"):
        SparseAdam(0.01, eps_form="fbgemm")
