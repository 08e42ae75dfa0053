"""hybridrec-export --retrieval: the catalogue's item vectors with their ids and both towers in
one file; a loaded export's topk equals the trainer's full-catalogue evaluation, list for
list; and a faiss-style inner-product search over the vectors finds the same items."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrec.distributed import init_distributed
from hybridrec.inference import RetrievalExport
from hybridrec.model import load_export
from hybridrec.train.export_cli import main as export_main
from hybridrec.train.trainer import Trainer
from tests.configs import make_config
from tests.retrieval.tables import TWO_TOWER, small_dataset, split_rows

# the module's tests share one module-scoped fixture: one test worker runs them all, so it
# is built once (scripts/test.sh: pytest-xdist --dist loadgroup)
pytestmark = pytest.mark.xdist_group("retrieval/test_export")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return small_dataset(tmp_path_factory.mktemp("retrieval"))


def test_exported_topk_equals_the_trainers_evaluation(data, tmp_path, capsys):
    cfg = make_config(
        "data=table", f"data.path={data}", "device=cpu", "train.batch_size=16",
        "train.steps=8", "eval.every=0", "eval.batch_size=6", "eval.topk=[5,20]",
        f"checkpoint.dir={tmp_path / 'ck'}", *TWO_TOWER, "+model.args.tower_mlp=[6]",
        "+model.args.normalize=true", "train.retrieval.temperature=0.3",
    )  # fmt: skip
    trainer = Trainer(cfg, init_distributed("cpu"))
    trainer.fit()
    metrics, lists = trainer.evaluate_topk("test", whole=True, lists=True)
    out = tmp_path / "model.pt"
    assert export_main([str(tmp_path / "ck"), str(out), "--retrieval"]) == 0
    printed = capsys.readouterr().out
    assert "every item of the dataset" in printed and ".topk(dense, ids, k" in printed
    model = load_export(out)
    assert isinstance(model, RetrievalExport)
    # the catalogue (every item of the data) less the items train never names (untrained)
    catalogue = sorted({i for _, i, _ in split_rows(data, "train")})
    assert model.item_ids.tolist() == catalogue
    assert model.item_vectors.shape == (len(catalogue), 6)
    # every test user's first row, its train and val items excluded: the trainer's lists
    rows = split_rows(data, "test")
    seen: dict[int, list[int]] = {}
    for split in ("train", "val"):
        for u, i, _ in split_rows(data, split):
            seen.setdefault(u, []).append(i)
    firsts = {}
    for u, i, age in rows:
        firsts.setdefault(u, (u, i, age))
    users = lists.users.tolist()
    dense = torch.tensor([[firsts[u][2]] for u in users], dtype=torch.float32)
    ids = torch.tensor([[u, firsts[u][1]] for u in users])
    items, scores = model.topk(dense, ids, 20, exclude=[seen.get(u, []) for u in users])
    assert torch.equal(items, lists.items)
    torch.testing.assert_close(scores, lists.scores, rtol=1e-5, atol=1e-6)
    hits = [items[n, :5].tolist().count(firsts[u][1]) for n, u in enumerate(users)]
    assert sum(hits) / len(users) == pytest.approx(metrics["hr@5"])  # one test item per user
    # the vectors in an inner-product index (what docs/training.md does with faiss)
    q = model.query(dense, ids)
    nearest = (q @ model.item_vectors.T).argmax(1)
    assert torch.equal(model.topk(dense, ids, 1)[0][:, 0], model.item_ids[nearest])
    # predict: each row's own (user, item) score
    want = (q * model.candidates(ids[:, 1])).sum(1)
    torch.testing.assert_close(model.predict(dense, ids), want)


def test_retrieval_export_refuses_what_it_cannot_do(data, tmp_path, capsys):
    cfg = make_config(
        "data=table", f"data.path={data}", "device=cpu", "train.batch_size=16",
        "train.steps=2", "eval.every=0", f"checkpoint.dir={tmp_path / 'ck'}", *TWO_TOWER,
    )  # fmt: skip
    Trainer(cfg, init_distributed("cpu")).fit()
    plain = tmp_path / "plain.pt"
    assert export_main([str(tmp_path / "ck"), str(plain)]) == 0
    with pytest.raises(ValueError, match="no item vectors: write it with hybridrec-export"):
        load_export(plain).topk(torch.zeros(1, 1), torch.zeros(1, 2, dtype=torch.long), 3)
    capsys.readouterr()
    missing = tmp_path / "nowhere"
    assert export_main([str(tmp_path / "ck"), str(plain), "--retrieval", "--data", str(missing)])
    err = capsys.readouterr().err
    assert (
        err.startswith("hybridrec-export: --retrieval needs the dataset") and err.count("\n") == 1
    )
    mf = make_config(
        "data=table", f"data.path={data}", "device=cpu", "train.batch_size=16", "train.steps=2",
        "eval.every=0", f"checkpoint.dir={tmp_path / 'mf'}", "model.arch=two_tower",
        "+model.args.user_features=[user_id]", "+model.args.item_features=[item_id]",
    )  # fmt: skip
    Trainer(mf, init_distributed("cpu")).fit()
    assert export_main([str(tmp_path / "mf"), str(tmp_path / "mf.pt"), "--retrieval"]) == 1
    assert "--retrieval exports a model.task=retrieval model; this one is regression" in (
        capsys.readouterr().err
    )
