"""The declared catalogue (train.retrieval.catalogue): every item of the data, every row of
the item table, a file or a list of ids; its size logged at start and in the metrics rows;
negatives drawn from it; the items the train split never names (untrained rows) never
ranked, in evaluation or in an export, however they would score; bad declarations refused
in one line. And the reporting of a run that evaluates val, then test: rows named by their
split, the closing line naming the split evaluated last."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.config import compose
from hybridrec.configure import validate
from hybridrec.data.dataset import open_dataset
from hybridrec.data.interactions import Interactions
from hybridrec.data.source import BinarySource
from hybridrec.distributed import init_distributed
from hybridrec.model import load_export
from hybridrec.train.export_cli import main as export_main
from hybridrec.train.trainer import Trainer
from tests.configs import make_config
from tests.retrieval.reference import python_topk
from tests.retrieval.tables import ITEMS, TWO_TOWER, small_dataset, split_rows

pytestmark = pytest.mark.xdist_group("retrieval/test_catalogue")

UNTRAINED = [20, 31]  # small_dataset's items that only its val or test split names
ROWS = ITEMS + 1  # the item table: the spec's rows and identity encoding's null row


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return small_dataset(tmp_path_factory.mktemp("catalogue"))


def cfg_for(data: Path, *extra: str):  # noqa: ANN201
    return make_config(
        "data=table", f"data.path={data}", "device=cpu", "train.batch_size=16", "train.steps=6",
        "eval.batch_size=7", "eval.topk=[1,5,20]", "optim.sparse.name=sgd", "optim.sparse.lr=1",
        "eval.every=0", *TWO_TOWER, *extra,
    )  # fmt: skip


def pairs(data: Path, declared) -> Interactions:  # noqa: ANN001
    return Interactions(BinarySource(open_dataset(data)), 0, 1, ROWS, declared)


def train_items(data: Path) -> list[int]:
    return sorted({i for _, i, _ in split_rows(data, "train")})


def test_the_catalogue_kinds(data, tmp_path):
    everything = sorted({i for s in ("train", "val", "test") for _, i, _ in split_rows(data, s)})
    assert set(UNTRAINED) == set(everything) - set(train_items(data))  # what the tests assume
    default = pairs(data, "data")
    assert default.catalogue().tolist() == everything
    assert default.ranked().tolist() == train_items(data)
    assert default.describe() == (
        f"retrieval catalogue: {len(everything)} items (train.retrieval.catalogue=data: every "
        f"item of the dataset's splits); 2 of them never in the train split, never ranked "
        f"(untrained rows), {len(everything) - 2} ranked"
    )
    table = pairs(data, "table")
    assert table.catalogue().tolist() == list(range(ROWS))
    assert table.ranked().tolist() == train_items(data)
    text = tmp_path / "items.txt"
    text.write_text("7\n\n3\n20\n3\n")  # blank lines skipped, a repeat counted once
    assert pairs(data, str(text)).catalogue().tolist() == [3, 7, 20]
    assert pairs(data, str(text)).ranked().tolist() == [3, 7]
    npy = tmp_path / "items.npy"
    np.save(npy, np.array([5, 1], dtype=np.int32))
    assert pairs(data, str(npy)).catalogue().tolist() == [1, 5]
    assert pairs(data, [9, 2]).catalogue().tolist() == [2, 9]


@pytest.mark.parametrize(
    "content,message",
    [
        ("4\nabc\n", r"items.txt: line 2 is 'abc', not an item id \(one integer per line\)"),
        (f"4\n{ROWS}\n", f"item id {ROWS} is outside the item table's {ROWS} rows"),
        ("\n", "the catalogue holds no item ids"),
    ],
)
def test_a_bad_catalogue_file_is_one_line(data, tmp_path, content, message):
    path = tmp_path / "items.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as e:
        pairs(data, str(path)).catalogue()
    assert "\n" not in str(e.value) and "train.retrieval.catalogue=" in str(e.value)
    floats = tmp_path / "f.npy"
    np.save(floats, np.array([1.5]))
    with pytest.raises(ValueError, match="holds a float64 array of shape \\[1\\]; a catalogue is"):
        pairs(data, str(floats)).catalogue()


@pytest.mark.parametrize(
    "value,message",
    [
        ("nowhere.txt", "train.retrieval.catalogue=nowhere.txt: not data, table or a file"),
        ("[3,-1]", r"a non-empty list of item ids \(integers >= 0\), got \[3, -1\]"),
        ("[]", r"a non-empty list of item ids"),
    ],
)
def test_a_bad_catalogue_setting_is_one_line(data, value, message):
    with pytest.raises(ValueError, match=message) as e:
        validate(compose(["data=table", f"data.path={data}", *TWO_TOWER,
                          f"train.retrieval.catalogue={value}"]))  # fmt: skip
    assert "\n" not in str(e.value)


def test_untrained_rows_never_outrank_trained_ones(data):
    """The untrained items' vectors planted where they beat every item for a user (their
    rows would be random: no positive ever trained them): still never ranked."""
    trainer = Trainer(cfg_for(data), init_distributed("cpu"))
    for s in range(6):
        trainer.train_step(trainer.train_batch(s))
    model, rows = trainer.model, split_rows(data, "val")
    user, item, age = rows[0]
    with torch.no_grad():
        q = model.query(torch.tensor([[age]]), trainer.keyed(torch.tensor([[user, item]])))[0]
    real = model.candidates

    def planted(ids: torch.Tensor) -> torch.Tensor:
        out = real(ids).clone()
        out[torch.isin(ids, torch.tensor(UNTRAINED))] = 1e3 * q
        return out

    model.candidates = planted  # what evaluation calls for the item vectors
    best = planted(torch.tensor(UNTRAINED + train_items(data))) @ q
    assert int(best.argmax()) < len(UNTRAINED)  # the plant beats every trained item
    metrics, lists = trainer.evaluate_topk("eval", whole=True, lists=True)
    assert not torch.isin(lists.items, torch.tensor(UNTRAINED)).any()
    want = python_topk(trainer, data, "val", train_items(data), 20)
    assert lists.items.tolist() == [want[u] for u in lists.users.tolist()]
    assert (metrics["catalogue_items"], metrics["catalogue_untrained"]) == (52, 2)


def test_a_declared_catalogue_is_what_trains_ranks_and_is_logged(data, tmp_path, caplog):
    """A file naming some items (among them items the users met, and the untrained ones):
    negatives come from it, evaluation ranks its trained items, each user's seen items
    excluded (items outside it exclude nothing), and its size is logged and in the rows."""
    chosen = train_items(data)[::2] + UNTRAINED
    path = tmp_path / "items.txt"
    path.write_text("".join(f"{i}\n" for i in chosen))
    cfg = cfg_for(data, f"train.retrieval.catalogue={path}", "train.retrieval.negatives=5")
    with caplog.at_level(logging.INFO, logger="hybridrec"):
        trainer = Trainer(cfg, init_distributed("cpu"))
    assert (
        f"retrieval catalogue: {len(chosen)} items (train.retrieval.catalogue={path}); 2 of "
        f"them never in the train split, never ranked (untrained rows), {len(chosen) - 2} "
        "ranked" in caplog.text
    )
    negatives = torch.cat([trainer.objective.retrieval.negatives(s) for s in range(1, 20)])
    assert set(negatives.tolist()) <= set(chosen)
    for s in range(6):
        trainer.train_step(trainer.train_batch(s))
    ranked = sorted(set(chosen) - set(UNTRAINED))
    for split, name in (("eval", "val"), ("test", "test")):
        metrics, lists = trainer.evaluate_topk(split, whole=True, lists=True)
        want = python_topk(trainer, data, name, ranked, 20)
        # fewer than 20 items left to rank: the list ends in -1
        assert lists.items.tolist() == [(want[u] + [-1] * 20)[:20] for u in lists.users.tolist()]
        assert metrics["catalogue_items"] == len(chosen)
        assert metrics["catalogue_untrained"] == 2


def test_rows_are_named_by_their_split_and_the_last_one_closes_the_run(data, tmp_path, caplog):
    """eval.final_split=test: the val row, then the test row; the closing line shows the
    test metrics, named; a table catalogue's size is in both rows."""
    cfg = cfg_for(data, "train.retrieval.catalogue=table", "eval.final_split=test",
                  "eval.batches=null")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="hybridrec"):
        Trainer(cfg, init_distributed("cpu"), run_dir=tmp_path / "run").fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    evals = [r for r in rows if r["split"] != "train"]
    assert [(r["step"], r["split"]) for r in evals] == [(6, "val"), (6, "test")]
    assert all(r["catalogue_items"] == ROWS for r in evals)
    assert all(r["catalogue_untrained"] == ROWS - len(train_items(data)) for r in evals)
    done = next(r.message for r in caplog.records if r.message.startswith("done: "))
    test = evals[-1]
    assert f"; test hr@1 {test['hr@1']:.4f}  ndcg@1 {test['ndcg@1']:.4f}  hr@5 " in done
    assert "; eval " not in done and "; val " not in done


def test_an_export_holds_the_trained_items_of_the_runs_catalogue(data, tmp_path, capsys):
    chosen = train_items(data)[1::3] + UNTRAINED
    cfg = cfg_for(data, f"checkpoint.dir={tmp_path / 'ck'}", f"train.retrieval.catalogue={chosen}")
    Trainer(cfg, init_distributed("cpu")).fit()
    out = tmp_path / "model.pt"
    assert export_main([str(tmp_path / "ck"), str(out), "--retrieval"]) == 0
    ranked = sorted(set(chosen) - set(UNTRAINED))
    assert load_export(out).item_ids.tolist() == ranked
    printed = capsys.readouterr().out
    assert f"and the vectors of {len(ranked)} items of the catalogue (" in printed
    assert f"{len(chosen)} items, less 2 never in its train split (untrained); data {data})" in (
        printed
    )
    assert export_main([str(tmp_path / "ck"), str(out), "--retrieval", "--catalogue", "table"]) == 0
    assert load_export(out).item_ids.tolist() == train_items(data)
    assert "(table: every row of the item table; 54 items, less 4 never" in capsys.readouterr().out
    bad = tmp_path / "bad.txt"
    bad.write_text("x\n")
    assert (
        export_main([str(tmp_path / "ck"), str(out), "--retrieval", "--catalogue", str(bad)]) == 1
    )
    err = capsys.readouterr().err
    assert err.startswith("hybridrec-export: train.retrieval.catalogue=") and err.count("\n") == 1
