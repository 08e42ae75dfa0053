"""The built-in model classes (two-tower, Wide & Deep: hybridrec/model/registry.py) through
the trainer on CUDA equal the same runs on the CPU: per-step losses and the evaluation after
them, with every table on the GPU and with host-memory tables behind caches (one NCCL rank,
the next batch prefetched as fit() trains).

fp32 (autocast off, TF32 off, no compile): the CPU reference and CUDA differ by round-off in
the order of sums, so losses agree to rtol 1e-5 and the evaluation's log loss too; AUC is a
ranking, where a near tie may swap, so it agrees to 2e-3.
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.distributed import destroy_distributed, init_distributed
from hybridrec.sparse.host import HostCachedEmbedding
from hybridrec.train.trainer import Trainer
from tests.configs import make_config

pytestmark = pytest.mark.gpu

STEPS = 8
MODELS = {
    "two_tower": (
        "model.arch=two_tower",
        "+model.args.user_features=[cat_0,cat_1]",
        "+model.args.item_features=[cat_2,cat_3]",
        "+model.args.tower_mlp=[16]",
        "optim.sparse.name=adam",  # element-wise state, also of the width-1 bias tables
    ),
    "wide_deep": ("model.arch=wide_deep", "optim.sparse.name=rowwise_adagrad"),
}
COMMON = (
    "train.batch_size=256",
    "eval.batch_size=256",
    "eval.batches=2",
    "train.log_every=1",
    "train.autocast=none",
    "train.compile=none",
    "seed=5",
)


def _losses_and_eval(trainer: Trainer, batches) -> tuple[list[float], dict]:  # noqa: ANN001
    losses = [float(x) for x in trainer.train_batches(batches)]
    return losses, trainer.evaluate()


@pytest.mark.parametrize("sharding", ["none", "host"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_built_in_model_class_trains_on_cuda_as_on_the_cpu(arch, sharding):
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        ref = Trainer(make_config(*MODELS[arch], *COMMON, "device=cpu"), init_distributed("cpu"))
        batches = [ref.train_batch(s) for s in range(STEPS)]
        want_losses, want_eval = _losses_and_eval(ref, batches)
        extra = ("sharding=host", "sharding.cache_fraction=0.05") if sharding == "host" else ()
        cfg = make_config(*MODELS[arch], *COMMON, "device=cuda", *extra)
        env = init_distributed("cuda", timeout_s=60, force_group=sharding == "host")
        try:
            trainer = Trainer(cfg, env)
            hosts = sum(isinstance(m, HostCachedEmbedding) for m in trainer.model.modules())
            assert (hosts > 0) == (sharding == "host")
            losses, got_eval = _losses_and_eval(trainer, batches)
        finally:
            destroy_distributed(env)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6
    )
    assert got_eval["logloss"] == pytest.approx(want_eval["logloss"], rel=1e-5)
    assert got_eval["auc"] == pytest.approx(want_eval["auc"], abs=2e-3)
