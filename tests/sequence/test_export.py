"""Serving a next-item model (hybridrec.next_item_serving, hybridrec-export of a
model.task=next_item checkpoint) at one rank: the export's top-K for each test user's history
equals the trainer's evaluation, user for user (tests/sequence/export_check.py; two ranks with
a sharded item table: tests/distributed/test_next_item_export.py), and what it refuses, in one
line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridrec.distributed import init_distributed
from hybridrec.inference import PredictInputError
from hybridrec.model import load_export
from hybridrec.safeload import load_tensors
from hybridrec.train.checkpoint.format import write_file
from hybridrec.train.export_cli import main as export_main
from hybridrec.train.trainer import Trainer
from tests.configs import make_config
from tests.sequence.export_check import (
    MAX_LEN,
    check_export,
    export,
    held_out,
    make_cfg,
    train_and_rank,
    write_events,
)

# one module-scoped run for every test here: one test worker (scripts/test.sh: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("sequence/test_export")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(the run's dir, its data file, train_and_rank's results) of SASRec on one rank."""
    tmp = tmp_path_factory.mktemp("next_item_export")
    data = write_events(tmp / "events.txt")
    want = train_and_rank(
        init_distributed("cpu"), make_cfg(data, "sasrec_bce", "none", 1, tmp / "ck")
    )
    return tmp, data, want


@pytest.fixture(scope="module")
def model(run):  # noqa: ANN201
    tmp, _, _ = run
    return export(tmp / "ck", tmp / "model.pt")


def test_export_topk_equals_the_trainers_evaluation(run, model):
    _, data, want = run
    assert want["losses"][-1] < want["losses"][0]
    assert len(set(want["full"].tolist())) > 10  # K = the catalogue: every rank is exact
    check_export(model, data, want)


def test_a_dynamic_item_tables_export_equals_its_evaluation(tmp_path):
    data = write_events(tmp_path / "events.txt")
    cfg = make_cfg(data, "dynamic", "none", 1, tmp_path / "ck")
    want = train_and_rank(init_distributed("cpu"), cfg)
    check_export(export(tmp_path / "ck", tmp_path / "model.pt"), data, want)


def test_histories_as_lists_or_padded_tensor_and_what_is_excluded(run, model):
    _, data, _ = run
    histories, _, _ = held_out(data)
    histories = histories[:5]
    items, scores = model.topk(histories, 20)
    width = max(map(len, histories))
    padded = torch.full((len(histories), width), -1)
    for q, h in enumerate(histories):
        padded[q, : len(h)] = torch.tensor(h)
    got = model.topk(padded, 20)
    assert torch.equal(got[0], items) and torch.equal(got[1], scores)
    for q, h in enumerate(histories):  # the whole history is left out, not only the last L
        assert not set(h) & set(items[q].tolist())
    # the state reads the most recent MAX_LEN events
    assert torch.equal(model.query(histories), model.query([h[-MAX_LEN:] for h in histories]))
    every = model.topk(histories, 150, exclude=None)[0]  # nothing left out: every item
    assert sorted(every[0].tolist()) == list(range(1, 151))
    mine = model.topk(histories, 20, exclude=[[int(items[q, 0])] for q in range(5)])[0]
    assert torch.equal(mine[:, 0], every[:, 0]) or (mine[:, 0] != items[:, 0]).all()
    for q in range(5):
        assert int(items[q, 0]) not in mine[q].tolist()
    # scores are score()'s, and predict's in the trainer's layout of rows (item id - 1)
    torch.testing.assert_close(model.score(histories, items), scores)
    ids = torch.full((5, model.offsets[-1]), -1)
    for q, h in enumerate(histories):
        kept = torch.tensor(h[-MAX_LEN:]) - 1
        ids[q, : len(kept)] = kept
        ids[q, MAX_LEN] = items[q, 3] - 1
    torch.testing.assert_close(model.predict(torch.zeros(5, 0), ids), scores[:, 3])
    assert model.item_base == 1 and model.item_vectors.shape == (150, 8)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda m: m.topk([[3, 4], []], 5), r"^histories\[1\] is empty: a next-item model"),
        (lambda m: m.topk([[0]], 5), r"^histories\[0\]: item id 0 is not in the catalogue \(item ids 1\.\.150"),
        (lambda m: m.topk([[3, 151]], 5), r"^histories\[0\]: item id 151 is not in the catalogue"),
        (lambda m: m.topk([[3]], 0), r"^k must be a whole number >= 1"),
        (lambda m: m.topk([[3.0]], 5), r"^histories\[0\]: 3\.0 is not an item id"),
        (lambda m: m.topk([3, 4], 5), r"^histories\[0\] must be a list of item ids"),
        (lambda m: m.topk(torch.tensor([[3, -1, 4]]), 5), r"^histories\[0\]: item id 4 at column 2 comes after a -1"),
        (lambda m: m.topk(torch.tensor([[3.0]]), 5), r"^histories must be an integer tensor"),
        (lambda m: m.topk([[3]], 5, exclude="seen"), r"^exclude must be 'history'"),
        (lambda m: m.topk([[3]], 5, exclude=[[1], [2]]), r"^exclude has 2 lists but the request has 1 rows"),
        (lambda m: m.score([[3]], [[1, 0]]), r"^items\[0\]\[1\]: item id 0 is not in the catalogue"),
        (lambda m: m.score([[3]], [1, 2]), r"^items must be item ids \[1, m\]"),
        (
            lambda m: m.predict(torch.zeros(1, 0), torch.tensor([[2, 5] + [-1] * (m.offsets[-1] - 2)])),
            r"^row 0: feature 'seq' has no item to score in position 6",
        ),
    ],
)  # fmt: skip
def test_refusals_are_one_line(model, call, message):
    with pytest.raises(PredictInputError, match=message) as e:
        call(model)
    assert "\n" not in str(e.value)


def test_the_export_cli_for_a_next_item_checkpoint(run, tmp_path, capsys):
    tmp, _, _ = run
    capsys.readouterr()
    out = tmp_path / "r.pt"
    assert export_main([str(tmp / "ck"), str(out), "--retrieval"]) == 0  # the same file
    printed = capsys.readouterr().out
    assert "every row of the item table (item ids 1..150" in printed
    assert ".topk(histories, k)" in printed
    assert torch.equal(load_export(out).item_vectors, load_export(tmp / "model.pt").item_vectors)
    assert export_main([str(tmp / "ck"), str(out), "--data", str(tmp)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridrec-export: --data") and "drop --data" in err
    assert err.count("\n") == 1
    # a checkpoint that does not record how its data numbers items
    old = tmp_path / "old"
    step = next((tmp / "ck").glob("step_*"))
    (old / step.name).mkdir(parents=True)
    for f in step.iterdir():
        (old / step.name / f.name).write_bytes(f.read_bytes())
    mf = old / step.name / "manifest.json"
    original = json.loads(mf.read_text())
    manifest = json.loads(mf.read_text())
    del manifest["extra"]["stream"]["data.sequence"]
    mf.write_text(json.dumps(manifest))
    assert export_main([str(old), str(out), "--no-verify"]) == 1
    err = capsys.readouterr().err
    assert "does not record its data.sequence settings" in err and err.count("\n") == 1
    # hand-edited settings: refused, not guessed
    for key, value in (("item_base", "1"), ("format", "xml")):
        manifest = json.loads(json.dumps(original))
        manifest["extra"]["stream"]["data.sequence"][key] = value
        mf.write_text(json.dumps(manifest))
        assert export_main([str(old), str(out), "--no-verify"]) == 1
        err = capsys.readouterr().err
        assert "data.sequence format" in err and repr(value) in err and err.count("\n") == 1
    # a catalogue that does not fit the item table
    state = load_tensors(tmp / "model.pt")
    state["retrieval.item_ids"] = state["retrieval.item_ids"].flip(0)
    write_file(state, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="are not the item table's 150 rows"):
        load_export(tmp_path / "bad.pt")


def test_an_interaction_tables_item_ids_are_served_as_the_table_numbers_them(tmp_path):
    rows = ["user,item,timestamp"]
    for u in range(12):
        rows += [f"{u},{100 + (u * 3 + j) % 20},{j}" for j in range(5)]
    (tmp_path / "events.csv").write_text("\n".join(rows) + "\n")
    cfg = make_config(
        "data=sequences", f"data.path={tmp_path / 'events.csv'}", "data.sequence.item_base=100",
        "data.sequence.max_len=4", "model=sasrec", "model.embedding_dim=4", "sharding=none",
        "train.batch_size=4", "train.steps=1", "device=cpu",
        f"checkpoint.dir={tmp_path / 'ck'}",
    )  # fmt: skip
    trainer = Trainer(cfg, init_distributed("cpu"))
    trainer.train_batches([trainer.train_batch(0)])
    trainer.save()
    model = export(tmp_path / "ck", tmp_path / "model.pt")
    assert model.item_ids.tolist() == list(range(100, 120))  # row r is item 100 + r
    items, _ = model.topk([[100, 103]], 20)
    assert sorted(items[0, :18].tolist()) == [i for i in range(100, 120) if i not in (100, 103)]
    with pytest.raises(
        PredictInputError, match=r"item id 99 is not in the catalogue \(item ids 100\.\.119"
    ):
        model.topk([[99]], 3)
