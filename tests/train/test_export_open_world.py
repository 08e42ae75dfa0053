"""The open-world path of exports (issue 41), tried as its users would.

- No loader imports what a checkpoint or an export names: a module planted on PYTHONPATH,
  named by a manifest's (or an export's) `_target_`, never runs through hybridrec-export,
  load_export, model.init_from, a resume or the conversion; the user names the class
  (`--model`, `load_export(path, model=...)`) and a mismatch is one line naming both.
- What used to be a traceback is one line `hybridrec-export: ...` (exit 2 for a usage
  error): a truncated checkpoint, a manifest naming another file, --data naming no dataset
  or another one, the conversion of a legacy or plain pickle, topk's k and exclude,
  load_export of a checkpoint directory.
- Top-K for a ranking export: every catalogue item scored by the model's own forward, in the
  retrieval export's order (ties by lower item id), raw dense values transformed by the
  export, and rows whose ids were never trained refused or flagged, never ranked silently.
"""

from __future__ import annotations

import importlib
import json
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.distributed import init_distributed
from hybridrec.inference import InferenceModel, PredictInputError, RetrievalExport, load_export
from hybridrec.safeload import torch_format
from hybridrec.train.checkpoint import export_checkpoint, list_checkpoints
from hybridrec.train.checkpoint.convert import main as convert_main
from hybridrec.train.checkpoint.export import NamedClassError
from hybridrec.train.checkpoint.format import sha256
from hybridrec.train.export_cli import main as export_main
from hybridrec.train.trainer import Trainer
from tests.configs import make_config
from tests.models.user_model import TinyUser
from tests.retrieval.tables import (
    ITEMS,
    TWO_TOWER,
    USERS,
    interactions,
    spec,
    split_rows,
    write_dataset,
)

# the module's tests share module-scoped fixtures: one test worker runs them all
pytestmark = pytest.mark.xdist_group("train/test_export_open_world")

TARGET = "tests.models.user_model.TinyUser"
SYNTHETIC = (
    "train.batch_size=32",
    "eval.batch_size=32",
    "eval.batches=1",
    "device=cpu",
    "train.steps=2",
    f"model._target_={TARGET}",
    "+model.args.dim=4",
)
UNSEEN = 5  # a user whose rows are all in the test split: its row is never trained
RANKING = (
    "model.arch=two_tower",
    "+model.args.user_features=[user_id]",
    "+model.args.item_features=[item_id]",
)


def _err(capsys) -> str:
    """The one line a CLI wrote to stderr."""
    err = capsys.readouterr().err
    assert err.startswith("hybridrec-export: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def target_ck(tmp_path_factory) -> Path:
    """A checkpoint of a user's class (model._target_) on synthetic data."""
    ck = tmp_path_factory.mktemp("target") / "ck"
    cfg = make_config(*SYNTHETIC, f"checkpoint.dir={ck}")
    Trainer(cfg, init_distributed("cpu")).fit()
    return ck


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> dict[str, Path]:
    """A table dataset (a standardized dense column) where user UNSEEN has no train row, a
    ranking and a retrieval model trained on it, both exported with the dataset recorded."""
    root = tmp_path_factory.mktemp("table")
    cols = interactions()
    cols["split"] = ["test" if u == UNSEEN else s for u, s in zip(cols["user_id"], cols["split"])]
    data = write_dataset(root / "data", cols, spec(USERS, ITEMS))
    out = {"root": root, "data": data}
    common = ("data=table", f"data.path={data}", "device=cpu", "train.batch_size=16")
    common += ("train.steps=6", "eval.every=0")
    for name, model in (
        ("ranking", RANKING),
        ("retrieval", (*TWO_TOWER, "+model.args.tower_mlp=[6]")),
    ):
        ck = root / f"{name}_ck"
        Trainer(make_config(*common, f"checkpoint.dir={ck}", *model), init_distributed("cpu")).fit()
        flags = ["--retrieval"] if name == "retrieval" else []
        assert export_main([str(ck), str(root / f"{name}.pt"), *flags]) == 0
        out[f"{name}_ck"], out[name] = ck, root / f"{name}.pt"
    return out


def _plant(root: Path) -> tuple[str, Path]:
    """A module `planted_evil` under root/mods whose import writes root/ran; (its class's
    import path, the marker)."""
    marker = root / "ran"
    mods = root / "mods"
    mods.mkdir()
    (mods / "planted_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from tests.models.user_model import TinyUser as Evil\n"
    )
    return "planted_evil.Evil", marker


def _retarget_checkpoint(src: Path, dst: Path, target: str) -> Path:
    shutil.copytree(src, dst)
    step = list_checkpoints(dst)[-1]
    m = json.loads((step / "manifest.json").read_text())
    m["extra"]["model"]["_target_"] = target
    (step / "manifest.json").write_text(json.dumps(m))
    return step


def test_no_loader_imports_what_a_checkpoint_or_an_export_names(
    target_ck, tmp_path, monkeypatch, capsys
):
    planted, marker = _plant(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    step = _retarget_checkpoint(target_ck, tmp_path / "ck", planted)
    out = tmp_path / "m.pt"
    # hybridrec-export: without --model, and with the class the user trained
    assert export_main([str(step), str(out)]) == 2
    err = _err(capsys)
    assert f"was trained with model._target_={planted}, a class of your own" in err
    assert "--model pkg.Class" in err
    assert export_main([str(step), str(out), "--model", TARGET]) == 2
    assert f"--model {TARGET}, but {step / 'manifest.json'} was trained with " in _err(capsys)
    with pytest.raises(NamedClassError, match=f"model._target_={planted}"):
        export_checkpoint(step, out)
    assert not out.exists()
    # an export whose model config names the planted class: load_export
    good = tmp_path / "good.pt"
    assert export_main([str(list_checkpoints(target_ck)[-1]), str(good), "--model", TARGET]) == 0
    state = torch.load(good, weights_only=True)
    cfg = json.loads(state["model_config"])
    torch.save({**state, "model_config": json.dumps({**cfg, "_target_": planted})}, out)
    with pytest.raises(ValueError, match=f"'_target_'='{planted}' is code to import") as e:
        load_export(out)
    assert "\n" not in str(e.value)
    for named in (TinyUser, TARGET):
        with pytest.raises(
            ValueError, match=f"trained with model._target_={planted}, but model={TARGET} was named"
        ):
            load_export(out, model=named)
    with pytest.raises(ValueError, match=r"trust_import=\.\.\.\) is gone: .*model=YourClass"):
        load_export(out, trust_import=True)
    # a warm start from that export and a resume from that checkpoint build the config's class
    warm = make_config(*SYNTHETIC, f"model.init_from={out}", "train.steps=1")
    Trainer(warm, init_distributed("cpu")).restore()
    resumed = make_config(*SYNTHETIC, f"checkpoint.dir={step.parent}", "train.steps=3")
    trainer = Trainer(resumed, init_distributed("cpu"))
    trainer.restore()
    assert trainer.step == 2
    assert convert_main([str(step)]) == 0
    assert not marker.exists() and "planted_evil" not in sys.modules
    # the plant works: importing it, as a loader would have, runs it
    importlib.import_module("planted_evil")
    assert marker.exists()
    del sys.modules["planted_evil"]


def test_the_class_named_is_compared_never_guessed(target_ck, table, tmp_path, capsys):
    out = tmp_path / "m.pt"
    step = list_checkpoints(target_ck)[-1]
    assert export_main([str(step), str(out), "--model", TARGET]) == 0
    printed = capsys.readouterr().out
    assert f"load_export({str(out)!r}, model={TARGET!r}).predict(dense, ids)" in printed
    assert "no dataset recorded" in printed  # synthetic data: nothing to record
    assert isinstance(load_export(out, model=TinyUser), InferenceModel)
    with pytest.raises(ValueError, match="but model=torch.nn.modules.linear.Linear was named"):
        load_export(out, model=torch.nn.Linear)
    with pytest.raises(ValueError, match="model= takes an nn.Module class or its import path"):
        load_export(out, model=3)
    # a built-in model needs no class, and naming one is refused
    assert export_main([str(table["ranking_ck"]), str(out), "--model", TARGET]) == 2
    assert "holds the built-in model.arch=two_tower, not a class of your own; drop" in _err(capsys)
    with pytest.raises(ValueError, match="holds the built-in model.arch=two_tower, but model="):
        load_export(table["ranking"], model=TinyUser)


def _fix_manifest(step: Path) -> None:
    """Sizes and checksums rewritten to the files' (as a damaged copy with a fresh manifest)."""
    mf = step / "manifest.json"
    m = json.loads(mf.read_text())
    for name in m["files"]:
        m["files"][name] = {"bytes": (step / name).stat().st_size, "sha256": sha256(step / name)}
    mf.write_text(json.dumps(m))


def test_export_errors_are_one_line(table, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(table["ranking_ck"], ck)
    step = list_checkpoints(ck)[-1]
    out = str(tmp_path / "m.pt")
    # a truncated shard file: by size, then with the manifest rewritten, then unverified
    shard = step / "shards_rank0.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert export_main([str(step), out]) == 1
    assert "shards_rank0.pt has 1000 bytes, the manifest says" in _err(capsys)
    _fix_manifest(step)
    for flags in ([], ["--no-verify"]):
        assert export_main([str(step), out, *flags]) == 1
        err = _err(capsys)
        assert f"checkpoint file {shard} cannot be read as a torch.save file (truncated" in err
    # a manifest naming a file outside the checkpoint
    m = json.loads((step / "manifest.json").read_text())
    m["files"]["../../x"] = m["files"].pop("dense.pt")
    (step / "manifest.json").write_text(json.dumps(m))
    assert export_main([str(step), out]) == 1
    assert "lists file '../../x', which is not one of this checkpoint's files" in _err(capsys)
    # --data naming no dataset, or another dataset than the model's
    good = str(table["ranking_ck"])
    nope = tmp_path / "nope"
    for flags in ([], ["--retrieval"]):
        assert export_main([good, out, "--data", str(nope), *flags]) == 2
        err = _err(capsys)
        assert f"--data {nope} holds no dataset (no manifest.json there)" in err
        assert ("--retrieval needs the dataset" in err) == bool(flags)
    other = interactions(seed=1)
    other["item_id"] = [i + 40 for i in other["item_id"]]
    other_data = write_dataset(tmp_path / "other", other, spec(USERS, ITEMS + 40))
    retrieval = str(table["retrieval_ck"])
    assert export_main([retrieval, out, "--retrieval", "--data", str(other_data)]) == 2
    err = _err(capsys)
    assert (
        f"dataset {other_data} is not the one the model was trained on: feature 'item_id' " in err
    )
    # the checkpoint's own data.path gone: named as the checkpoint's, not as --data
    moved = tmp_path / "moved"
    shutil.copytree(table["retrieval_ck"], moved)
    mstep = list_checkpoints(moved)[-1]
    m = json.loads((mstep / "manifest.json").read_text())
    m["extra"]["stream"]["data.path"] = str(nope)
    (mstep / "manifest.json").write_text(json.dumps(m))
    assert export_main([str(moved), out, "--retrieval"]) == 1
    assert f"the checkpoint's data.path '{nope}' holds no dataset; give it with --data" in (
        _err(capsys)
    )
    assert not Path(out).exists()


def test_convert_of_a_legacy_file_and_of_a_plain_pickle(table, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(table["ranking_ck"], ck)
    step = list_checkpoints(ck)[-1]
    dense = torch.load(step / "dense.pt", weights_only=True)
    torch.save(dense, step / "dense.pt", _use_new_zipfile_serialization=False)
    _fix_manifest(step)
    assert torch_format(step / "dense.pt") == "legacy"
    assert convert_main([str(step)]) == 0
    assert "converted dense.pt" in capsys.readouterr().out
    assert torch_format(step / "dense.pt") == "zip"
    assert export_main([str(step), str(tmp_path / "m.pt")]) == 0
    with (step / "dense.pt").open("wb") as f:
        pickle.dump(dense, f)
    _fix_manifest(step)
    capsys.readouterr()
    assert convert_main([str(step)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dense.pt: refused: it is not a file torch.save wrote" in err
    assert "It was not written by hybridrec (a foreign file): neither load nor convert it" in err


def test_load_export_of_a_checkpoint_directory_names_the_command(table):
    ck = table["ranking_ck"]
    for path in (ck, list_checkpoints(ck)[-1]):
        with pytest.raises(
            ValueError, match="is a checkpoint directory, not an exported model"
        ) as e:
            load_export(path)
        assert f"`hybridrec-export {path} model.pt`" in str(e.value)


def _requests(data: Path, split: str = "test") -> tuple[torch.Tensor, torch.Tensor, list]:
    """Each user's first row of `split`: stored dense [Q, 1], ids [Q, 2], the users."""
    first: dict[int, tuple] = {}
    for u, i, age in split_rows(data, split):
        first.setdefault(u, (u, i, age))
    rows = sorted(first.values())
    dense = torch.tensor([[age] for _, _, age in rows], dtype=torch.float32)
    return dense, torch.tensor([[u, i] for u, i, _ in rows]), [u for u, _, _ in rows]


def _train_items(data: Path) -> list[int]:
    return sorted({i for _, i, _ in split_rows(data, "train")})


@pytest.mark.parametrize("kind", ["ranking", "retrieval"])
def test_topk_arguments_are_checked(table, kind):
    model = load_export(table[kind])
    dense, ids, users = _requests(table["data"], "val")
    n = len(_train_items(table["data"])) if kind == "ranking" else len(model.item_ids)
    for k in (-1, 0, True, 2.5, "3"):
        with pytest.raises(PredictInputError, match=r"^k must be a whole number >= 1") as e:
            model.topk(dense, ids, k)
        assert "\n" not in str(e.value)
    items, scores = model.topk(dense, ids, n + 3)  # past the catalogue: -1 and -inf
    assert (items[:, :n] >= 0).all() and (items[:, n:] == -1).all()
    assert torch.isinf(scores[:, n:]).all() and torch.isfinite(scores[:, :n]).all()
    for exclude in ([[1]], [[]] * (len(users) + 1)):
        with pytest.raises(
            PredictInputError,
            match=f"^exclude has {len(exclude)} lists but the request has {len(users)} rows",
        ):
            model.topk(dense, ids, 3, exclude=exclude)
    with pytest.raises(PredictInputError, match="untrained must be one of"):
        model.topk(dense, ids, 3, untrained="skip")


@torch.no_grad()
def _brute_force(model: InferenceModel, dense, ids, items: list[int], k: int):
    """Each row scored against every item by forward, one row (all items) per call."""
    out = []
    for r in range(len(ids)):
        x = ids[r].repeat(len(items), 1)
        x[:, 1] = torch.tensor(items)
        s = model(dense[r].repeat(len(items), 1), x)
        order = sorted(range(len(items)), key=lambda j: (-float(s[j]), items[j]))[:k]
        out.append(([items[j] for j in order], s[order]))
    return out


def test_ranking_topk_scores_every_trained_item_through_forward(table):
    data = table["data"]
    model = load_export(table["ranking"])
    assert not isinstance(model, RetrievalExport) and model.dense_transforms is not None
    dense, ids, users = _requests(data, "val")
    catalogue = _train_items(data)
    got_items, got_scores = model.topk(dense, ids, 10, batch=len(catalogue))
    for r, (items, scores) in enumerate(_brute_force(model, dense, ids, catalogue, 10)):
        assert got_items[r].tolist() == items
        assert torch.equal(got_scores[r], scores)
    # any batch gives the same lists; raw dense values, transformed by the export, too
    cols = interactions()
    raw = {}
    for u, s, age in zip(cols["user_id"], cols["split"], cols["age"]):
        if s == "val":
            raw.setdefault(u, age)
    raw_dense = torch.tensor([[raw[u]] for u in users], dtype=torch.float64)
    assert torch.equal(model.dense_inputs(raw_dense, raw=True), dense)
    small = model.topk(raw_dense, ids, 10, batch=7, raw=True)
    assert torch.equal(small[0], got_items)
    torch.testing.assert_close(small[1], got_scores)
    # exclusion, and an explicit catalogue
    base, _ = model.topk(dense, ids, 10)
    seen = [[int(x) for x in base[r, :3]] for r in range(len(users))]
    items, _ = model.topk(dense, ids, 7, exclude=seen)
    assert torch.equal(items, base[:, 3:10])
    picked, _ = model.topk(dense, ids, 3, items=[catalogue[4], catalogue[1], catalogue[4]])
    assert picked[:, :2].sort(1).values.tolist() == [sorted([catalogue[1], catalogue[4]])] * len(
        users
    )
    assert (picked[:, 2] == -1).all()


def test_ranking_and_retrieval_break_ties_by_lower_item_id(table):
    """Two items with identical rows score identically; both exports list the lower id first,
    as the trainer's evaluation does."""
    a, b = 3, 9
    for kind in ("ranking", "retrieval"):
        model = load_export(table[kind])
        with torch.no_grad():
            for key, w in model.expected().items():
                if key.startswith("embeddings.") and "item_id" in key:
                    w[b] = w[a]
        if kind == "retrieval":
            model.item_vectors = model.candidates(model.item_ids)
        dense, ids, _ = _requests(table["data"], "val")
        items, scores = model.topk(dense, ids, 60)
        for r in range(len(items)):
            row = items[r].tolist()
            assert row.index(a) + 1 == row.index(b), (kind, row)
            assert scores[r, row.index(a)] == scores[r, row.index(b)]


@pytest.mark.parametrize("kind", ["ranking", "retrieval"])
def test_a_row_without_a_trained_user_is_refused_or_flagged(table, kind):
    model = load_export(table[kind])
    dense, ids, users = _requests(table["data"], "test")
    at = users.index(UNSEEN)
    with pytest.raises(
        PredictInputError, match=f"^row {at}: feature 'user_id' id {UNSEEN} has no trained row"
    ) as e:
        model.topk(dense, ids, 5)
    assert "\n" not in str(e.value)
    flagged = model.topk(dense, ids, 5, untrained="empty")
    scored = model.topk(dense, ids, 5, untrained="score")
    assert (flagged[0][at] == -1).all() and torch.isinf(flagged[1][at]).all()
    keep = torch.arange(len(users)) != at
    assert torch.equal(flagged[0][keep], scored[0][keep]) and (scored[0][at] >= 0).all()
    null = ids.clone()
    null[0, 0] = USERS  # the null row: no user id was ever null in train
    with pytest.raises(PredictInputError, match=f"^row 0: feature 'user_id' id {USERS} has no"):
        model.topk(dense[keep][:1], null[:1], 5)


def test_ranking_topk_catalogue_refusals(table, target_ck, tmp_path):
    model = load_export(table["ranking"])
    dense, ids, _ = _requests(table["data"], "val")
    never = sorted(set(range(ITEMS)) - set(_train_items(table["data"])))
    assert never  # items only in val or test
    with pytest.raises(PredictInputError, match=f"items: id {never[0]} of item feature 'item_id'"):
        model.topk(dense, ids, 3, items=[never[0], 1])
    items, _ = model.topk(dense, ids, 3, items=[never[0], 1], untrained="empty")
    assert (items[:, 0] == 1).all() and (items[:, 1:] == -1).all()
    with pytest.raises(PredictInputError, match=r"items: id 999 is not an id of item feature"):
        model.topk(dense, ids, 3, items=[999])
    del model.trained["user_id"]  # as an export written without its dataset
    with pytest.raises(PredictInputError, match=r"does not record which rows of feature 'user_id'"):
        model.topk(dense, ids, 3, items=[1])
    # a model without `item_feature`, exported without a dataset (synthetic data)
    out = tmp_path / "m.pt"
    assert export_main([str(target_ck), str(out), "--model", TARGET]) == 0
    mine = load_export(out, model=TinyUser)
    d, x = torch.randn(4, 13), torch.randint(0, 3, (4, 6))
    with pytest.raises(PredictInputError, match=r"topk needs the feature whose ids are the items"):
        mine.topk(d, x, 3)
    with pytest.raises(
        PredictInputError, match=r"does not record which ids of item feature 'cat_1'"
    ):
        mine.topk(d, x, 3, item_feature="cat_1")
    with pytest.raises(PredictInputError, match=r"item feature 'cat_1' were trained: pass untr"):
        mine.topk(d, x, 3, item_feature="cat_1", items=np.arange(50))
    with pytest.raises(PredictInputError, match=r"^raw=True: this export does not record"):
        mine.predict(d, x, raw=True)
    items, scores = mine.topk(d, x, 3, item_feature="cat_1", items=np.arange(50), untrained="score")
    assert items.shape == (4, 3) and (items >= 0).all() and torch.isfinite(scores).all()


def test_retrieval_topk_takes_raw_dense_values(table):
    model = load_export(table["retrieval"])
    dense, ids, users = _requests(table["data"], "val")
    cols = interactions()
    raw = {}
    for u, s, age in zip(cols["user_id"], cols["split"], cols["age"]):
        if s == "val":
            raw.setdefault(u, age)
    raw_dense = torch.tensor([[raw[u]] for u in users], dtype=torch.float64)
    want = model.topk(dense, ids, 8)
    got = model.topk(raw_dense, ids, 8, raw=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_dynamic_tables_ids_have_rows_when_its_map_holds_them(tmp_path):
    """A dynamic table needs no record: an id has a row when the export's map holds it, and
    its default catalogue is the ids the map holds."""
    target = "tests.models.user_model.DynamicUser"
    cfg = make_config(*SYNTHETIC[:5], f"model._target_={target}", "+model.args.dim=4",
                      "optim.sparse.name=adagrad", f"checkpoint.dir={tmp_path / 'ck'}")  # fmt: skip
    Trainer(cfg, init_distributed("cpu")).fit()
    out = tmp_path / "m.pt"
    assert export_main([str(tmp_path / "ck"), str(out), "--model", target]) == 0
    model = load_export(out, model=target)
    slots = torch.load(out, weights_only=True)["embeddings.a.c2.slot_id"]
    held = slots[slots >= 0]
    assert 0 < len(held) < len(slots)  # admitted ids, and free or unknown rows
    ids = torch.cat([held[:3], torch.tensor([10**12])])
    assert model.has_row(2)(ids).tolist() == [True, True, True, False]  # cat_2's table
    d, x = torch.randn(4, 13), torch.randint(0, 3, (4, 6))
    items, scores = model.topk(d, x, 5, item_feature="cat_2", untrained="score")
    assert set(items.flatten().tolist()) <= set(held.tolist()) and torch.isfinite(scores).all()
