"""Specs without dense columns (issue 32, item 5): a pure id/label table preprocesses to a
dataset with a zero-width dense array, `data=table` fills model.num_dense_features=0, models
that read no dense input train on it (equally on 1 and 2 ranks), and DLRM, whose bottom MLP
needs dense inputs, is refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridrec.config import compose
from hybridrec.configure import validate
from hybridrec.data.dataset import open_dataset
from hybridrec.data.manifest import Manifest
from hybridrec.data.preprocess_cli import main as preprocess_main
from hybridrec.data.source import BinarySource
from hybridrec.data.spec import parse_spec
from hybridrec.data.tabular import preprocess_table
from hybridrec.inference import load_export
from hybridrec.train.export_cli import main as export_main
from tests.cli import run_cli
from tests.data.tables import N, movies, spec_dict, write_csv, write_parquet, write_spec

NO_DENSE = spec_dict(dense=[])
del NO_DENSE["dense"]  # no `dense` key at all, as a user writes such a spec
# a regression table for tests.models.user_model.Ratings (user, movie, genres)
RATINGS = spec_dict(label={"column": "rating", "task": "regression"})
del RATINGS["dense"]
RATINGS["sparse"] = [s for s in RATINGS["sparse"] if s["name"] != "zip"]
RATINGS["tables"] = [t for t in RATINGS["tables"] if t["name"] != "zip"]
DLRM_REFUSED = (
    "model.arch={arch} needs dense inputs (its bottom MLP reads them) but the data has none "
    "(model.num_dense_features=0); train a model that reads none (model.arch=two_tower, or your "
    "own model._target_), or add a dense column to the spec"
)


def test_a_spec_may_list_no_dense_column():
    for d in (NO_DENSE, spec_dict(dense=[]), spec_dict(dense=None)):
        spec = parse_spec(d)
        assert spec.dense == () and "age" not in spec.columns()
    assert parse_spec(spec_dict(dense=[])).fingerprint() == parse_spec(NO_DENSE).fingerprint()


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_no_dense_columns_give_the_same_labels_and_ids_and_a_zero_width_dense_array(tmp_path, fmt):
    """The same table with and without its dense column: labels and ids bit for bit equal,
    dense [N, 0] (a header-only file, one CRC per block), read back as [B, 0] batches."""
    cols = movies()
    write = write_parquet if fmt == "parquet" else write_csv
    src = write(tmp_path / f"movies.{fmt}", cols)
    preprocess_table(parse_spec(spec_dict()), [src], tmp_path / "with", block_rows=8)
    report = preprocess_table(parse_spec(NO_DENSE), [src], tmp_path / "without", block_rows=8)
    with_dense = open_dataset(tmp_path / "with", verify="full")
    ds = open_dataset(tmp_path / "without", verify="full")  # every block's CRC checked
    assert ds.dense.shape == (N, 0) and ds.dense.dtype == np.float32
    np.testing.assert_array_equal(ds.labels, with_dense.labels)
    np.testing.assert_array_equal(ds.categorical, with_dense.categorical)
    assert ds.manifest.splits == with_dense.manifest.splits
    m = Manifest.load(tmp_path / "without")
    assert m.arrays["dense"].row_shape == [0] and len(m.arrays["dense"].block_crc32) == 5
    assert m.schema["dense"]["fields"] == [] and m.schema["dense"]["shape"] == ["N", 0]
    assert not any(": dense (" in line for line in report.lines)
    assert len(report.lines) == 1 + len(NO_DENSE["sparse"])
    source = BinarySource(ds, shuffle=False)
    batch = source.batch(0, 8, "train")
    assert batch.dense.shape == (8, 0) and batch.ids.shape == (8, 6)
    np.testing.assert_array_equal(batch.ids.numpy(), with_dense.categorical[:8])
    ds_read = open_dataset(tmp_path / "without", verify="read")
    ds_read.check_rows(0, N)  # the lazily checked blocks too


def test_the_cli_preprocesses_a_spec_without_dense_columns(tmp_path, capsys):
    src = write_parquet(tmp_path / "movies.parquet", movies())
    spec = write_spec(tmp_path / "spec.yaml", NO_DENSE)
    out = tmp_path / "bin"
    assert preprocess_main(["--spec", str(spec), "--input", str(src), "--output", str(out)]) == 0
    printed = capsys.readouterr()
    assert "dense" not in printed.out + printed.err
    assert open_dataset(out).dense.shape == (N, 0)


def test_data_table_fills_zero_dense_features_and_dlrm_is_refused_in_one_line(tmp_path):
    src = write_parquet(tmp_path / "movies.parquet", movies())
    preprocess_table(parse_spec(NO_DENSE), [src], tmp_path / "bin", block_rows=8)
    data = ["data=table", f"data.path={tmp_path / 'bin'}"]
    two_tower = [
        "model.arch=two_tower",
        "+model.args.user_features=[user,zip]",
        "+model.args.item_features=[movie,genres]",
    ]
    assert validate(compose([*data, *two_tower])).model.num_dense_features == 0
    for arch in ("dlrm", "dcnv2"):
        with pytest.raises(ValueError) as e:
            validate(compose([*data, f"model.arch={arch}"]))
        assert str(e.value) == DLRM_REFUSED.format(arch=arch)
    with pytest.raises(ValueError, match=r"^model.num_dense_features=1 contradicts the dataset"):
        validate(compose([*data, *two_tower, "model.num_dense_features=1"]))
    out = run_cli(*data, "train.steps=1", cwd=tmp_path)  # the default model: DLRM
    assert out.returncode == 2
    assert out.stderr == f"hybridrec-train: {DLRM_REFUSED.format(arch='dlrm')}\n"


# the models of test_models_that_read_no_dense_input_train_equally_on_1_and_2_ranks: one case
# each, so that test workers share them out
DENSE_FREE_MODELS = {
    "mf": (
        "model.arch=two_tower",
        "+model.args.user_features=[user]",
        "+model.args.item_features=[movie]",
        "+model.args.tower_mlp=[]",
    ),
    "wide_deep": ("model.arch=wide_deep",),  # its dense layer reads 0 columns
    "user_model": ("model._target_=tests.models.user_model.Ratings",),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DENSE_FREE_MODELS))
def test_models_that_read_no_dense_input_train_equally_on_1_and_2_ranks(name, tmp_path):
    """two_tower as matrix factorisation (tower_mlp empty), wide_deep and a user's model
    (tests.models.user_model.Ratings) on a regression table without dense columns: one
    process, and 2 ranks row-wise with the broadcast loader, give the same losses and final
    test evaluation; the exported MF model scores [B, 0] dense inputs as training did."""
    src = write_parquet(tmp_path / "movies.parquet", movies(80))
    spec = write_spec(tmp_path / "spec.yaml", RATINGS)
    preprocess_table(parse_spec(RATINGS), [src], tmp_path / "bin", block_rows=8)
    common = (
        "data=table",
        f"data.path={tmp_path / 'bin'}",
        f"data.spec={spec}",
        "train.steps=4",
        "train.batch_size=8",
        "train.log_every=1",
        "eval.batch_size=8",
        "eval.batches=null",
        "eval.final_split=test",
        "optim.dense.name=sgd",
        "device=cpu",
    )
    model = DENSE_FREE_MODELS[name]
    runs = {}
    for ranks, extra in (
        (1, (f"checkpoint.dir={tmp_path / name / 'ckpt'}",)),
        (2, ("launcher.nproc_per_node=2", "sharding=row_wise", "data.loader=broadcast")),
    ):
        run = tmp_path / name / str(ranks)
        out = run_cli(*common, *model, *extra, f"hydra.run.dir={run}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[ranks] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    one, two = runs[1], runs[2]
    assert one[-1]["split"] == "test" and one[-1]["eval_samples"] == 20
    for key in ("loss", "rmse"):
        a = [r[key] for r in one if key in r]
        b = [r[key] for r in two if key in r]
        assert len(a) == len(b) > 0 and np.isfinite(a).all(), (name, key)
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (name, key)
    if name != "mf":
        return
    assert export_main([str(tmp_path / "mf" / "ckpt"), str(tmp_path / "mf.pt")]) == 0
    model = load_export(tmp_path / "mf.pt")
    test = BinarySource(open_dataset(tmp_path / "bin"), shuffle=False).batch(0, 20, "test")
    assert test.dense.shape == (20, 0)
    pred = model.predict(test.dense, test.ids)
    rmse = float(((pred - test.labels) ** 2).mean().sqrt())
    assert rmse == pytest.approx(one[-1]["rmse"], rel=1e-5)
