"""train.compile=dense: the dense part under torch.compile trains like eager (CPU inductor),
and checkpoints see through the wrapper. Tolerance: compiled kernels fuse and reorder float32
math, so losses agree to round-off (rtol 1e-4)."""

from __future__ import annotations

import pytest
import torch

from hybridrec.distributed import init_distributed
from hybridrec.train.checkpoint.format import unwrap
from hybridrec.train.trainer import Trainer
from tests.distributed.test_equivalence import make_cfg

pytestmark = pytest.mark.slow


def _losses(compile_mode: str) -> tuple[list[float], Trainer]:
    cfg = make_cfg("none", "rowwise_adagrad", 1)
    cfg.train.compile = compile_mode
    t = Trainer(cfg, init_distributed("cpu"))
    return [float(t.train_step(t.train_batch(s))) for s in range(3)], t


def test_compiled_dense_matches_eager():
    eager, _ = _losses("none")
    compiled, t = _losses("dense")
    assert hasattr(t.model.dense, "_orig_mod")
    assert type(unwrap(t.model.dense)).__name__ == "DenseArch"
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-5)
