"""Retrieval in one process, against plain references written here: the top-K order, the
metrics, the full-catalogue evaluation (every user scored against every item in Python), the
loss (the softmax written out) and its logQ; a model's own loss is what trains; and the
config and model contract refuse what cannot work, in one line."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.config import compose
from hybridrec.configure import validate
from hybridrec.distributed import init_distributed
from hybridrec.model.retrieval import NO_ITEM, decode_keys, order_keys, top_keys
from hybridrec.train.metrics import TopKMetrics
from hybridrec.train.retrieval import retrieval_loss
from hybridrec.train.trainer import Trainer
from tests.configs import make_config
from tests.retrieval.tables import TWO_TOWER, small_dataset, split_rows

# the module's tests share one module-scoped fixture: one test worker runs them all, so it
# is built once (scripts/test.sh: pytest-xdist --dist loadgroup)
pytestmark = pytest.mark.xdist_group("retrieval/test_retrieval")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return small_dataset(tmp_path_factory.mktemp("retrieval"))


def cfg_for(data: Path, *extra: str):  # noqa: ANN201
    return make_config(
        "data=table", f"data.path={data}", "device=cpu", "train.batch_size=16", "train.steps=6",
        "eval.batch_size=7", "eval.topk=[1,5,20]", "optim.sparse.name=sgd", "optim.sparse.lr=1",
        *TWO_TOWER, *extra,
    )  # fmt: skip


def test_keys_order_by_score_then_lower_item_and_decode_exactly():
    scores = torch.tensor([0.5, -1.0, 0.5, 0.0, -0.0, 2.0, -1.0, float("-inf"), 1e-30, -1e-30])
    items = torch.tensor([7, 3, 2, 9, 4, 0, 1, 5, 8, 6])
    keys = order_keys(scores, items)
    order = keys.argsort(descending=True)
    want = sorted(range(10), key=lambda i: (-float(scores[i]), int(items[i])))
    assert order.tolist() == want  # -0.0 ties with 0.0: the lower item (4) first
    got_items, got_scores = decode_keys(keys)
    assert torch.equal(got_items, items)
    assert torch.equal(got_scores, scores + 0.0)
    best = top_keys(keys.view(1, -1), 12)  # more than there are: padded
    assert best[0, 10:].tolist() == [NO_ITEM, NO_ITEM]
    assert decode_keys(best)[0][0].tolist() == [items[i] for i in want] + [-1, -1]


def test_metrics_by_hand():
    m = TopKMetrics([1, 3])
    hits = torch.tensor([[True, False, False], [False, False, True], [False, True, True]])
    m.add(hits, torch.tensor([1, 1, 4]))
    r = m.result()
    assert r["hr@1"] == pytest.approx(1 / 3) and r["hr@3"] == pytest.approx(1.0)
    assert r["recall@3"] == pytest.approx((1 + 1 + 2 / 4) / 3)
    ideal3 = 1 + 1 / math.log2(3) + 1 / math.log2(4)
    want = (1 + 1 / math.log2(4) + (1 / math.log2(3) + 1 / math.log2(4)) / ideal3) / 3
    assert r["ndcg@3"] == pytest.approx(want)


@pytest.mark.parametrize("split", ["eval", "test"])
def test_evaluation_equals_every_item_scored_in_python(data, split):
    cfg = cfg_for(data, "+model.args.tower_mlp=[6]", "train.retrieval.negatives=3")
    trainer = Trainer(cfg, init_distributed("cpu"))
    for s in range(cfg.train.steps):
        trainer.train_step(trainer.train_batch(s))
    metrics, lists = trainer.evaluate_topk(split, whole=True, lists=True)
    name = "val" if split == "eval" else split
    seen_splits = ["train"] if name == "val" else ["train", "val"]
    seen: dict[int, set[int]] = {}
    for s in seen_splits:
        for u, i, _ in split_rows(data, s):
            seen.setdefault(u, set()).add(i)
    rows = split_rows(data, name)
    # the catalogue (every item of the data) less the items train never names: those ranked
    catalogue = sorted({i for _, i, _ in split_rows(data, "train")})
    model = trainer.model
    model.eval()
    with torch.no_grad():
        items = model.candidates(torch.tensor(catalogue)).double()
    users, tops, ref = [], [], TopKMetrics([1, 5, 20])
    for u in dict.fromkeys(r[0] for r in rows):  # order of first appearance
        first = next(r for r in rows if r[0] == u)
        positives = {i for uu, i, _ in rows if uu == u}
        ids = trainer.keyed(torch.tensor([[u, first[1]]]))
        with torch.no_grad():
            q = model.query(torch.tensor([[first[2]]], dtype=torch.float32), ids).double()
        scores = (items @ q[0]).tolist()
        ranked = sorted(
            (i for i in range(len(catalogue)) if catalogue[i] not in seen.get(u, set())),
            key=lambda i: (-scores[i], catalogue[i]),
        )[:20]
        top = [catalogue[i] for i in ranked]
        users.append(u)
        tops.append(top)
        ref.add(torch.tensor([[i in positives for i in top]]), torch.tensor([len(positives)]))
    assert lists.users.tolist() == users
    assert lists.items.tolist() == tops
    want = ref.result()
    for k, v in want.items():
        assert metrics[k] == pytest.approx(v, abs=1e-12), k
    assert metrics["eval_samples"] == len(users) and len(users) == len({r[0] for r in rows})
    assert metrics["hr@20"] > 0


def test_loss_is_the_softmax_written_out():
    g = torch.Generator().manual_seed(0)
    b, m, d = 6, 3, 4
    query = torch.randn(b, d, generator=g)
    cands = torch.randn(b + m, d, generator=g)
    ids = torch.tensor([4, 2, 4, 7, 1, 2, 9, 4, 3])  # repeats: accidental hits
    log_q = torch.randn(b + m, generator=g)
    got = retrieval_loss(query, cands, ids, temperature=0.5, log_q=log_q,
                         remove_accidental_hits=True)  # fmt: skip
    total = 0.0
    for i in range(b):
        logits = [
            float(query[i] @ cands[j]) / 0.5 - float(log_q[j])
            for j in range(b + m)
            if j == i or ids[j] != ids[i]
        ]
        own = float(query[i] @ cands[i]) / 0.5 - float(log_q[i])
        total += math.log(sum(math.exp(x) for x in logits)) - own
    assert float(got) == pytest.approx(total / b, rel=1e-5)
    plain = retrieval_loss(query, cands, ids)
    want = torch.nn.functional.cross_entropy(query @ cands.T, torch.arange(b))
    torch.testing.assert_close(plain, want)


def test_logq_is_the_expected_count_among_the_candidates(data):
    cfg = cfg_for(data, "train.retrieval.negatives=4")
    trainer = Trainer(cfg, init_distributed("cpu"))
    objective = trainer.objective.retrieval
    counts = np.bincount(
        [i for _, i, _ in split_rows(data, "train")], minlength=objective.log_q.numel()
    )
    catalogue = trainer.objective.interactions.catalogue()
    seen = counts > 0
    want = np.log(16 * counts[seen] / counts.sum() + 4 / len(catalogue))
    np.testing.assert_allclose(objective.log_q[torch.from_numpy(seen)].numpy(), want, rtol=1e-6)
    a, b = objective.negatives(3), objective.negatives(3)
    assert torch.equal(a, b) and not torch.equal(a, objective.negatives(4))
    assert set(a.tolist()) <= set(catalogue.tolist())


def test_the_models_own_loss_is_what_trains(data):
    cfg = make_config(
        "data=table", f"data.path={data}", "device=cpu", "train.batch_size=16",
        "model._target_=tests.retrieval.models.L2MF", "+model.args.l2=0.5", "train.steps=2",
    )  # fmt: skip
    trainer = Trainer(cfg, init_distributed("cpu"))
    batch = trainer.train_batch(0)
    model = trainer.model
    with torch.no_grad():
        rating, u, v = model(batch.dense, trainer.keyed(batch.ids))
        mse = torch.nn.functional.mse_loss(rating, batch.labels)
        want = mse + 0.5 * ((u.square().sum(1) + v.square().sum(1)).mean() + model.bias**2)
    got = trainer.train_step(batch)
    torch.testing.assert_close(got, want)
    assert trainer.evaluate(whole=True)["rmse"] > 0  # scores the first output


@pytest.mark.parametrize(
    "args,message",
    [
        (
            [*TWO_TOWER[:2], "model.arch=dlrm"],
            "model.task=retrieval needs a model with a user tower and an item tower",
        ),
        ([*TWO_TOWER, "train.retrieval.temperature=0"], "temperature must be > 0, got 0.0"),
        ([*TWO_TOWER, "train.retrieval.negatives=-1"], "negatives must be >= 0, got -1"),
        ([*TWO_TOWER, "eval.topk=[10,0]"], r"eval.topk must list positive integers"),
        (
            ["model.task=retrieval", "model._target_=tests.retrieval.models.DotOnly"],
            "DotOnly is not a retrieval model .*: it lacks query, candidates, user_feature, "
            "item_feature",
        ),
        (
            [*TWO_TOWER[:3], "+model.args.item_features=[item_id,user_id]"],
            r"the item tower reads one feature, the item id .* got model.args.item_features=",
        ),
    ],
)
def test_config_mistakes_are_one_line(data, args, message):
    with pytest.raises(ValueError, match=message) as e:
        validate(compose(["data=table", f"data.path={data}", *args]))
    assert "\n" not in str(e.value)


def test_retrieval_needs_a_table_dataset():
    with pytest.raises(ValueError, match="model.task=retrieval .* needs data=table"):
        validate(compose(TWO_TOWER))
