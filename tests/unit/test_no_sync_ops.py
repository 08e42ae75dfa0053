"""CPU stand-in for tests/gpu/test_gpu_nosync.py: a Triton training step issues no op that
makes CUDA wait for the device.

On the GPU, torch.cuda.set_sync_debug_mode("error") proves it; here a TorchDispatchMode
records every aten op of whole training steps (kernels in Triton's CPU interpreter) and
flags those that synchronise on CUDA: reading a value (.item(), int(), bool(): the op
_local_scalar_dense), or ops whose output size depends on the data (nonzero, unique,
masked_select, boolean indexing, bincount, repeat_interleave without output_size). It
cannot see device-to-host copies (a no-op on CPU); the GPU test does. The torch kernel path
dedupes with torch.unique (small calls) or unique_consecutive after a sort, and must be
flagged, so the detector is shown to work.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from hybridrec.distributed import DistEnv
from hybridrec.kernels import _common, dispatch, native
from hybridrec.train.trainer import Trainer
from tests.distributed.test_equivalence import make_cfg

pytest.importorskip("triton")

SYNCING = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::masked_select",
    "aten::is_nonzero",
    "aten::equal",
    "aten::bincount",
    "aten::histc",
}


class SyncRecorder(TorchDispatchMode):
    """Counts the ops of `SYNCING` (and data-dependent variants) dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = func._schema.name
        self.total += 1
        if name in SYNCING:
            self.ops[name] += 1
        elif name == "aten::index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or []
        ):
            self.ops["aten::index (boolean mask)"] += 1
        elif name == "aten::repeat_interleave" and kwargs.get("output_size") is None:
            self.ops[name] += 1
        return func(*args, **kwargs)


@pytest.fixture
def interpreted_kernels(monkeypatch):
    """Triton in its CPU interpreter; the interpreter's own tensor handling during a launch is
    not the step's and is not recorded."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real = _common.jitted

    class Unrecorded:
        def __init__(self, kernel) -> None:  # noqa: ANN001
            self.kernel = kernel

        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                with _disable_current_modes():
                    return self.kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(_common, "jitted", lambda fn: Unrecorded(real(fn)))
    yield
    dispatch.set_kernels("auto")


def _syncing_ops(sparse: str, kernels: str, check_ids: bool = False) -> SyncRecorder:
    cfg = make_cfg("none", sparse, 1)
    cfg.train.check_ids = check_ids
    cfg.train.kernels = kernels
    trainer = Trainer(cfg, DistEnv(device=torch.device("cpu")))
    if check_ids:  # deferred, as on CUDA (on the CPU the checks raise at once: they sync)
        trainer.embeddings[0].checker.defer = True
        trainer.dense_checks["train"].defer = True
    batches = [trainer.train_batch(s) for s in range(3)]
    trainer.train_step(batches[0])  # warmup, as the GPU test
    recorder = SyncRecorder()
    with recorder:
        for b in batches[1:]:
            trainer.train_step(b)
    return recorder


@pytest.mark.parametrize("check_ids", [False, True])
@pytest.mark.parametrize("sparse", ["sgd", "rowwise_adagrad", "adam", "adagrad"])
def test_triton_training_step_has_no_syncing_op(interpreted_kernels, sparse, check_ids):
    rec = _syncing_ops(sparse, "triton", check_ids)
    assert rec.total > 200  # the whole step was seen (lookup, MLPs, backward, updates)
    assert not rec.ops, f"ops that make CUDA wait for the device: {dict(rec.ops)}"


def test_the_detector_flags_the_torch_path_dedupe(interpreted_kernels):
    with native.disabled():  # the torch ops' dedupe (the C kernels' is one opaque call)
        rec = _syncing_ops("sgd", "torch")
    assert rec.ops["aten::_unique2"] + rec.ops["aten::unique_consecutive"] > 0
