"""On one GPU: the full sharded path over a real one-rank NCCL group (input dist, lookup,
output dist, backward exchanges, DDP) equals the CPU single-process reference.

Two NCCL ranks cannot share one GPU, so multi-rank equivalence is proven on CPU/gloo
(tests/distributed); this test makes sure the CUDA + NCCL code path runs and agrees.
Tolerance: fp32 everywhere (TF32 and bf16 autocast off); CUDA kernels sum in a different
order than the CPU ones, so agreement is to float32 round-off after a few steps
(rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.distributed import destroy_distributed, init_distributed
from hybridrec.train.trainer import Trainer
from tests.equivalence import STEPS, assemble, make_cfg

pytestmark = pytest.mark.gpu


def _train(cfg, env):
    trainer = Trainer(cfg, env)
    losses = [trainer.global_mean(trainer.train_step(trainer.train_batch(s))) for s in range(STEPS)]
    shards = [
        (spec, w.cpu(), {k: v.cpu() for k, v in st.items()})
        for spec, w, st in trainer.embeddings[0].shard_views()
    ]
    return losses, shards


@pytest.mark.parametrize("mode", ["table_wise", "column_wise", "row_wise", "data_parallel", "auto"])
@pytest.mark.parametrize("sparse", ["sgd", "rowwise_adagrad", "adam"])
def test_one_rank_nccl_sharded_equals_cpu_reference(mode, sparse):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref_cfg = make_cfg("none", sparse, 1)
    ref_losses, ref_shards = _train(ref_cfg, init_distributed("cpu"))
    cfg = make_cfg(mode, sparse, 1)
    cfg.device, cfg.train.autocast = "cuda", "none"
    env = init_distributed("cuda", timeout_s=60, force_group=True)
    try:
        assert env.backend == "nccl"
        losses, shards = _train(cfg, env)
    finally:
        destroy_distributed(env)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    got, want = assemble(cfg, [{"shards": shards}]), assemble(ref_cfg, [{"shards": ref_shards}])
    for table, entries in want.items():
        for name, value in entries.items():
            torch.testing.assert_close(got[table][name], value, rtol=1e-4, atol=1e-5)


def test_bf16_training_on_gpu_learns():
    cfg = make_cfg("auto", "rowwise_adagrad", 1)
    cfg.device, cfg.train.steps, cfg.eval.batches = "cuda", 60, 2
    cfg.train.log_every = 20
    env = init_distributed("cuda", timeout_s=60, force_group=True)
    try:
        result = Trainer(cfg, env).fit()
    finally:
        destroy_distributed(env)
    assert result["eval"]["auc"] > 0.6


def test_device_prefetcher_copies_ahead_on_cuda():
    from hybridrec.data.device import DevicePrefetcher
    from hybridrec.types import Batch

    src = [
        Batch(
            torch.randn(4, 13).pin_memory(),
            torch.randint(0, 9, (4, 2)).pin_memory(),
            torch.rand(4).pin_memory(),
        )
        for _ in range(3)
    ]
    got = list(DevicePrefetcher(iter(src), torch.device("cuda")))
    assert len(got) == 3
    for g, s in zip(got, src):
        assert g.ids.is_cuda and torch.equal(g.ids.cpu(), s.ids)
        assert torch.equal(g.dense.cpu(), s.dense)
