"""docs/library.md's own evaluation code, run as written (read out of the page), on 1 and 2 gloo
ranks: a model trained on the same global batches evaluates to the same metrics, with the last
batch of the split uneven (rank 1 gets no sample of it) and a batch larger than the training
batch. A page whose example stops running fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import hybridrec
from hybridrec import EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.optim import RowWiseAdagrad
from tests.distributed.harness import spawn

pytestmark = pytest.mark.slow
DOC = Path(__file__).resolve().parents[2] / "docs" / "library.md"
NAMES, HOT = ["user_id", "follows", "item_id"], [1, 4, 1]


def doc_code(marker: str) -> dict:
    """The names the page's python block holding `marker` defines, run as written."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    found = [b for b in blocks if marker in b]
    assert found, f"docs/library.md has no python block with {marker!r}"
    names: dict = {}
    exec(found[0], names)  # noqa: S102 (the project's own page)
    return names


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = EmbeddingTables(
            [Table("user", rows=500, dim=8), Table("item", rows=300, dim=8)],
            [
                Feature("user_id", "user"),
                Feature("follows", "user", hotness=4, jagged=True),
                Feature("item_id", "item"),
            ],
        )
        self.mlp = nn.Sequential(nn.Linear(3 * 8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids: KeyedIds) -> torch.Tensor:
        pooled = self.emb(ids)
        return self.mlp(torch.cat([pooled[f] for f in pooled], dim=1)).squeeze(1)


def _samples(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    users = torch.randint(0, 500, (n, 5), generator=g)
    users[:, 1:][torch.rand(n, 4, generator=g) < 0.5] = -1
    values = torch.cat([users, torch.randint(0, 300, (n, 1), generator=g)], 1)
    return values, ((values[:, 0] + values[:, 5]) % 2).float()


def _train_and_evaluate(env) -> tuple[dict, list[int]]:  # noqa: ANN001
    code = doc_code("def evaluate")
    my_slice, evaluate = code["my_slice"], code["evaluate"]
    rank, world = env.rank, env.world_size
    torch.manual_seed(0)
    model = hybridrec.parallelize(Model(), batch_size=64, sparse_optimizer=RowWiseAdagrad(0.1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(4):  # the same global batches on any number of ranks
        values, labels = _samples(64, step)
        mine = my_slice(64, rank, world)
        out = model(KeyedIds(values[mine], NAMES, HOT))
        nn.functional.binary_cross_entropy_with_logits(out, labels[mine]).backward()
        opt.step()
        opt.zero_grad()
    values, labels = _samples(301, 99)  # global batches of 150: 150, 150 and 1 sample
    batches = []
    for lo in range(0, 301, 150):
        v, y = values[lo : lo + 150], labels[lo : lo + 150]
        mine = my_slice(len(v), rank, world)
        batches.append((KeyedIds(v[mine], NAMES, HOT), y[mine]))
    return evaluate(model, batches), [len(y) for _, y in batches]


def test_the_pages_evaluation_gives_one_processs_metrics_on_two_ranks():
    [(one, sizes_one)] = spawn(1, _train_and_evaluate)
    two = spawn(2, _train_and_evaluate)
    assert sizes_one == [150, 150, 1]
    assert [s for _, s in two] == [[75, 75, 1], [75, 75, 0]]  # rank 1: an empty last batch
    assert two[0][0] == two[1][0]  # every rank has the metrics
    assert set(one) == {"auc", "logloss", "ne", "calibration", "accuracy"}
    for key, value in one.items():
        assert two[0][0][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert 0.0 < one["auc"] < 1.0
