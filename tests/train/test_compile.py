"""train.compile=dense compiles any model's dense computation (CPU inductor) around its eager
table lookups, trains like eager, and leaves the state dict's keys as they are (checkpoints
see no wrapper). Tolerance: compiled kernels fuse and reorder float32 math, so losses agree to
round-off (rtol 1e-4)."""

from __future__ import annotations

import pytest

from hybridrec.distributed import init_distributed
from hybridrec.train.checkpoint.format import dense_state
from hybridrec.train.trainer import Trainer
from tests.equivalence import make_cfg

pytestmark = pytest.mark.slow
TWO_TOWER = [
    "model.arch=two_tower",
    "+model.args.user_features=[cat_0,cat_1]",
    "+model.args.item_features=[cat_2,cat_3]",
]


def _losses(compile_mode: str, model: list[str]) -> tuple[list[float], Trainer]:
    cfg = make_cfg("none", "rowwise_adagrad", 1, "sum", *model)
    cfg.train.compile = compile_mode
    t = Trainer(cfg, init_distributed("cpu"))
    return [float(t.train_step(t.train_batch(s))) for s in range(3)], t


@pytest.mark.parametrize("model", [[], TWO_TOWER], ids=["dlrm", "two_tower"])
def test_compiled_model_matches_eager(model):
    import torch._dynamo

    eager, plain = _losses("none", model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled, t = _losses("dense", model)
    assert t.model._compiled_call_impl is not None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # a graph ran
    assert set(dense_state(t.model)) == set(dense_state(plain.model))
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-5)
