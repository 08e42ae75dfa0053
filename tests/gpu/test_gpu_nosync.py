"""On one GPU: a training step makes no host synchronisation (CUDA sync-debug mode).

sharding=none, Triton kernels, with and without train.check_ids (on CUDA the id check is
deferred: bad ids read as 0 and the run stops at the next logging step). A warmup step first
(first launches compile kernels and allocate); then torch.cuda.set_sync_debug_mode("error")
turns any synchronising call inside train_step into an error.
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.distributed import DistEnv
from hybridrec.train.trainer import Trainer
from tests.equivalence import make_cfg

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("check_ids", [True, False])
@pytest.mark.parametrize("sparse", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("compile_mode", ["none", "dense"])
def test_train_step_never_syncs(sparse, compile_mode, check_ids):
    cfg = make_cfg("none", sparse, 1)
    cfg.device, cfg.train.check_ids = "cuda", check_ids
    cfg.train.kernels, cfg.train.compile = "triton", compile_mode
    trainer = Trainer(cfg, DistEnv(device=torch.device("cuda")))
    batches = [trainer.train_batch(s).to("cuda") for s in range(3)]
    trainer.train_step(batches[0])  # warmup: compiles kernels, fills allocator caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in batches[1:]:
            trainer.train_step(b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_cuda_graphs_dense_trains_like_eager():
    """train.compile=graphs (torch.compile mode reduce-overhead: CUDA graph replay) gives the
    eager losses to float32 round-off (fp32 MLPs, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    losses = {}
    for mode in ("none", "graphs"):
        cfg = make_cfg("none", "rowwise_adagrad", 1)
        cfg.device, cfg.train.autocast, cfg.train.compile = "cuda", "none", mode
        trainer = Trainer(cfg, DistEnv(device=torch.device("cuda")))
        losses[mode] = [float(trainer.train_step(trainer.train_batch(s))) for s in range(6)]
    torch.testing.assert_close(
        torch.tensor(losses["graphs"]), torch.tensor(losses["none"]), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("compile_mode", ["none", "dense"])
def test_bf16_pooled_handoff_trains_bit_for_bit(compile_mode):
    """Under bf16 autocast the lookup hands DLRM's dot interaction bf16 pooled embeddings
    (and takes a bf16 gradient): the same losses, tables and dense weights, bit for bit, as
    fp32 pooled embeddings that the interaction casts itself."""
    results = {}
    for handoff in (False, True):
        cfg = make_cfg("none", "rowwise_adagrad", 1)
        cfg.device, cfg.train.kernels, cfg.train.compile = "cuda", "triton", compile_mode
        trainer = Trainer(cfg, DistEnv(device=torch.device("cuda")))
        trainer.embeddings[0].autocast_output = handoff
        losses = [trainer.train_step(trainer.train_batch(s)) for s in range(4)]
        views = trainer.embeddings[0].shard_views()
        state = [t.clone() for _, w, st in views for t in (w, *st.values())]
        dense = [p.detach().clone() for p in trainer.model.parameters()]
        results[handoff] = (torch.stack(losses), state + dense)
    assert torch.equal(results[True][0], results[False][0])
    for a, b in zip(results[True][1], results[False][1], strict=True):
        assert torch.equal(a, b)
