"""Models by config (hybridrec.model.registry, hybridrec.builder): built-in two_tower and
wide_deep and a user's class by `model._target_` train through the trainer and the CLI,
export and score like the trainer's model, and every mismatch is one clear line."""

from __future__ import annotations

import pytest
import torch

from hybridrec.distributed import init_distributed
from hybridrec.model import InferenceModel, load_export
from hybridrec.train.export_cli import main as export_main
from hybridrec.train.trainer import Trainer
from tests.cli import run_cli
from tests.configs import make_config

SMALL = (
    "train.batch_size=32",
    "eval.batch_size=32",
    "eval.batches=1",
    "train.log_every=1",
    "device=cpu",
    "optim.sparse.name=adam",  # element-wise state, also of the width-1 bias tables
)
TWO_TOWER = (
    "model.arch=two_tower",
    "+model.args.user_features=[cat_0,cat_1]",
    "+model.args.item_features=[cat_2,cat_3]",
    "+model.args.tower_mlp=[8]",
)
USER = ("model._target_=tests.models.user_model.TinyUser", "+model.args.dim=4")


def _train_and_export(tmp_path, *overrides, flags=()):
    cfg = make_config(*SMALL, "train.steps=3", f"checkpoint.dir={tmp_path / 'ck'}", *overrides)
    trainer = Trainer(cfg, init_distributed("cpu"))
    trainer.fit()
    out = tmp_path / "model.pt"
    assert export_main([str(tmp_path / "ck"), str(out), *flags]) == 0
    batch = trainer.train_batch(7)
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.score(batch.dense, batch.ids)
    return out, batch, want


def test_two_tower_export_scores_like_the_trainer(tmp_path):
    out, batch, want = _train_and_export(tmp_path, *TWO_TOWER)
    shapes = {
        k: v.shape for k, v in torch.load(out, weights_only=True).items() if k != "model_config"
    }
    assert list(shapes["embeddings.users.cat_1.weight"]) == [1200, 16]
    assert list(shapes["embeddings.item_bias.cat_3.weight"]) == [100, 1]
    assert "dense.user_mlp.0.weight" in shapes and "dense.bias" in shapes
    model = load_export(out)  # a registry name: rebuilt without importing anything
    assert isinstance(model, InferenceModel)
    torch.testing.assert_close(model(batch.dense, batch.ids), want, rtol=1e-6, atol=1e-6)
    p = model.predict(batch.dense, batch.ids)
    assert p.shape == (batch.size,) and ((p > 0) & (p < 1)).all()
    # a warm start from the file (model.init_from) scores the same
    warm = make_config(*SMALL, *TWO_TOWER, "train.steps=1", f"model.init_from={out}")
    trainer = Trainer(warm, init_distributed("cpu"))
    trainer.restore()
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(trainer.score(batch.dense, batch.ids), want, rtol=0, atol=0)


def test_wide_deep_export_scores_like_the_trainer(tmp_path):
    out, batch, want = _train_and_export(tmp_path, "model.arch=wide_deep")
    state = torch.load(out, weights_only=True)
    assert list(state["embeddings.wide.cat_0.weight"].shape) == [5000, 1]
    assert list(state["embeddings.deep.cat_0.weight"].shape) == [5000, 16]
    model = load_export(out)
    torch.testing.assert_close(model(batch.dense, batch.ids), want, rtol=1e-6, atol=1e-6)


def test_a_user_class_is_built_only_when_the_caller_names_it(tmp_path, capsys):
    """Nothing an export names is imported: its `_target_` is compared with the class the
    caller names (tests/train/test_export_open_world.py plants a module to prove it)."""
    target = "tests.models.user_model.TinyUser"
    out, batch, want = _train_and_export(tmp_path, *USER, flags=("--model", target))
    assert f"load_export({str(out)!r}, model={target!r})" in capsys.readouterr().out
    with pytest.raises(
        ValueError, match=r"'_target_'='tests.models.user_model.TinyUser'.*model="
    ) as e:
        load_export(out)
    assert "\n" not in str(e.value)
    model = load_export(out, model=target)
    torch.testing.assert_close(model(batch.dense, batch.ids), want, rtol=1e-6, atol=1e-6)
    from tests.models.user_model import TinyUser

    torch.testing.assert_close(load_export(out, model=TinyUser)(batch.dense, batch.ids), want)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ("model._target_=tests.models.nowhere.Model",),
            r"model._target_=tests.models.nowhere.Model does not import: ModuleNotFoundError",
        ),
        (
            ("model._target_=tests.models.user_model.WrongHotness",),
            r"feature 'cat_0' reads 3 ids per sample, the dataset has 1",
        ),
        ((*USER, "+model.args.depth=2"), r"model.args do not fit its __init__: .*depth"),
        (
            ("model._target_=tests.models.user_model.NoTables",),
            r"NoTables declares no EmbeddingTables: declare its tables",
        ),
        (
            ("model._target_=tests.models.user_model.EmptyTables",),
            r"^model._target_=tests.models.user_model.EmptyTables: EmbeddingTables needs at least "
            r"one Table$",
        ),
        (
            ("model._target_=tests.models.user_model.ShortTable",),
            r"table 't' has 10 rows, but the dataset's feature 'cat_0' has ids up to 4999",
        ),
        (
            (
                "model.arch=two_tower",
                "+model.args.user_features=[cat_0]",
                "+model.args.item_features=[movie]",
            ),
            r"model.args.item_features: \['movie'\] are not features of the dataset",
        ),
        (
            (
                "model.arch=two_tower",
                "+model.args.user_features=[cat_0]",
                "+model.args.item_features=[cat_1,cat_2]",
                "+model.args.tower_mlp=[]",
            ),
            r"the user tower is 16 wide and the item tower 32; the dot product needs one width",
        ),
        (("+model.args.dim=3",), r"model.args \['dim'\] are keyword arguments of a model class"),
        (
            ("model.arch=wide_deep", "sharding=auto", "+sharding.tables.deep.cat_0=row_wise"),
            r"is pinned as 'sharding.tables={deep.cat_0: row_wise}'",
        ),
        (
            ("model.arch=wide_deep", "+model.args.features=[]"),
            r"model.args.features: model.arch=wide_deep gets features from the dataset",
        ),
    ],
)
def test_model_config_errors_are_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as e:
        make_config(*overrides)
    assert "\n" not in str(e.value)


def test_cli_trains_built_in_models_and_names_bad_targets(tmp_path):
    for name, args in (("two_tower", TWO_TOWER), ("wide_deep", ("model.arch=wide_deep",))):
        run = run_cli(
            *SMALL, "train.steps=3", *args, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert (tmp_path / name / "metrics.jsonl").read_text().count('"split": "train"') == 3
    bad = run_cli("model._target_=my_pkg.Missing", cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr == (
        "hybridrec-train: model._target_=my_pkg.Missing does not import: ModuleNotFoundError: "
        "No module named 'my_pkg' (is its package on PYTHONPATH?)\n"
    )
    plus = run_cli("model.arch=wide_deep", "model.args.deep_mlp=[8]", cwd=tmp_path)
    assert plus.returncode == 2 and plus.stderr == (
        "hybridrec-train: model.args.deep_mlp: model arguments are added with a plus: "
        "+model.args.deep_mlp=[8] (or all at once: '+model.args={name: value, ...}')\n"
    )
    wrong = run_cli("model._target_=tests.models.user_model.WrongHotness", cwd=tmp_path)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1
    assert wrong.stderr.startswith("hybridrec-train: model._target_=tests.models.user_model.")
