"""Training through the Triton kernels (Triton's CPU interpreter here, compiled on CUDA) equals
training through the torch ops: sharding=none (fixed and jagged bags) and host-resident
tables, every optimizer.

Tolerance: the kernels sum pooled rows and per-row gradients in another order than torch's
ops (see tests/unit/test_triton_ops.py), so results agree to float32 round-off.
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.distributed import DistEnv
from hybridrec.kernels import dispatch
from hybridrec.train.trainer import Trainer
from tests.distributed.harness import spawn
from tests.equivalence import collect, host_cfg, jagged_cfg, make_cfg

pytest.importorskip("triton")
STEPS = 3


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
    dispatch.set_kernels("auto")


def _train(cfg) -> tuple[list[float], list[torch.Tensor]]:
    trainer = Trainer(cfg, DistEnv(device=torch.device("cpu")))
    losses = [float(trainer.train_step(trainer.train_batch(s))) for s in range(STEPS)]
    state = [
        t.clone() for _, w, st in trainer.embeddings[0].shard_views() for t in (w, *st.values())
    ]
    return losses, state


@pytest.mark.parametrize(
    "sparse,model",
    [
        ("sgd", "fixed"),
        ("rowwise_adagrad", "fixed"),
        ("adam", "fixed"),
        ("adam", "dcnv2"),  # jagged bags (empty ones too), mean pooling, widths 4 and 8
        ("rowwise_adagrad", "dlrm"),  # jagged, one width: the sample-major lookup
    ],
)
def test_triton_kernels_train_like_torch_ops(interpreter, sparse, model):
    if model == "fixed":
        cfg = make_cfg("none", sparse, 1)
    else:
        cfg = jagged_cfg("none", sparse, 1, arch=model)
    cfg.train.kernels = "torch"
    ref_losses, ref_state = _train(cfg)
    cfg.train.kernels = "triton"
    losses, state = _train(cfg)
    assert dispatch.available(torch.zeros(1))  # the kernels really ran (interpreted)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for a, b in zip(state, ref_state, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _host_both(env, cfg):
    """The torch ops' run, then the Triton kernels' run, one after the other in one rank (as
    the fixed-bag cases do in one process): one spawn instead of two."""
    runs = {}
    for kernels in ("torch", "triton"):
        cfg.train.kernels = kernels
        runs[kernels] = collect(env, cfg, prefetch=True)
        runs[kernels]["kernels_ran"] = dispatch.available(torch.zeros(1))
    return runs


def test_host_cache_through_triton_kernels(interpreter):
    cfg = host_cfg("host", "rowwise_adagrad", 1)
    [runs] = spawn(1, _host_both, cfg)  # the child inherits TRITON_INTERPRET=1
    ref, got = runs["torch"], runs["triton"]
    assert not ref["kernels_ran"] and got["kernels_ran"]  # each run took the path it names
    assert got["stats"].rows_written > 0
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6
    )
    for (_, a, sa), (_, b, sb) in zip(got["shards"], ref["shards"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for k in sb:
            torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-6)


def test_triton_mode_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="train.kernels=triton needs a CUDA device"):
        dispatch.set_kernels("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="is not one of: auto, torch, triton"):
        dispatch.set_kernels("cuda")
    dispatch.set_kernels("auto")
