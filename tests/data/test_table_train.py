"""data=table: the model's tables come from the dataset, contradictions and wrong specs are one
line, and `hybridrec-train data=table` trains, list features included, equally on 1 and 2
ranks."""

from __future__ import annotations

import json

import pytest

from hybridrec.config import compose
from hybridrec.configure import validate
from hybridrec.data.build import build_source
from hybridrec.data.spec import parse_spec
from hybridrec.data.tabular import preprocess_table
from tests.cli import run_cli
from tests.data.tables import SPEC, movies, spec_dict, write_parquet, write_spec


@pytest.fixture
def table_dir(tmp_path):
    src = write_parquet(tmp_path / "movies.parquet", movies())
    preprocess_table(parse_spec(SPEC), [src], tmp_path / "bin", block_rows=8)
    return tmp_path / "bin"


def test_the_model_is_filled_from_the_manifest(table_dir):
    cfg = validate(compose(["data=table", f"data.path={table_dir}", "train.batch_size=4"]))
    m = cfg.model
    assert m.name == "table" and m.task == "binary" and m.num_dense_features == 1
    assert m.table_names == m.feature_names == ["user", "movie", "zip", "genres"]
    assert [t.storage for t in m.tables()] == [None] * 4  # no feature shares a table
    assert m.num_embeddings_per_feature == [7, 14, 1000, 7]
    assert m.embedding_dims == [8, 8, 8, 8] and m.embedding_dim == 8 and m.bottom_mlp == [64, 8]
    assert m.hotness == [1, 1, 1, 3] and m.jagged == [False, False, False, True]
    assert m.pooling == ["sum", "sum", "sum", "mean"]
    assert [t.hotness for t in m.tables()] == [1, 1, 1, 3]
    assert validate(cfg).model == m  # what a rank or a resumed checkpoint re-validates
    source = build_source(cfg)
    assert source.batch(0, 4).ids.shape == (4, 6)


def test_overrides_that_contradict_the_dataset_name_the_key_and_its_value(table_dir):
    ok = validate(compose(["data=table", f"data.path={table_dir}", "model.embedding_dim=8"]))
    assert ok.model.embedding_dim == 8
    with pytest.raises(ValueError) as e:
        validate(compose(["data=table", f"data.path={table_dir}", "model.hotness=1"]))
    assert str(e.value) == (
        f"model.hotness=1 contradicts the dataset {table_dir}: it has [1, 1, 1, 3]; leave "
        "model.hotness unset with data=table (model=table takes it from the dataset)"
    )
    with pytest.raises(
        ValueError, match=r"^model.task=regression contradicts the dataset .*: it has binary;"
    ):
        validate(compose(["data=table", f"data.path={table_dir}", "model.task=regression"]))
    with pytest.raises(ValueError, match=r"^model.num_dense_features=13 contradicts"):
        validate(compose(["data=table", f"data.path={table_dir}", "model=dlrm_tiny"]))


def test_data_spec_must_be_the_one_the_data_was_made_with(table_dir, tmp_path):
    same = write_spec(tmp_path / "same.yaml", SPEC)
    assert validate(compose(["data=table", f"data.path={table_dir}", f"data.spec={same}"]))
    other = write_spec(
        tmp_path / "other.yaml", spec_dict(split={"by": "rows", "train_fraction": 0.6})
    )
    with pytest.raises(ValueError) as e:
        validate(compose(["data=table", f"data.path={table_dir}", f"data.spec={other}"]))
    msg = str(e.value)
    assert msg.startswith(f"data.spec={other} is not the spec {table_dir} was preprocessed with")
    assert msg.endswith(
        f"re-run hybridrec-preprocess --spec {other} --input ... --output {table_dir}, or point "
        "data.path at its output"
    )
    with pytest.raises(
        ValueError, match="^data.spec applies to data=table, not data.name=synthetic$"
    ):
        validate(compose([f"data.spec={same}"]))


def test_data_table_needs_a_path_to_a_table_dataset(tmp_path):
    with pytest.raises(ValueError, match="^data=table needs data.path: a directory made by"):
        validate(compose(["data=table"]))
    with pytest.raises(ValueError, match="not found: .* is not a preprocessed dataset"):
        validate(compose(["data=table", f"data.path={tmp_path}"]))


def test_a_criteo_directory_is_refused_with_data_table(sample_dataset):
    with pytest.raises(ValueError, match="holds Criteo data, not a table made from a dataset spec"):
        validate(compose(["data=table", f"data.path={sample_dataset}"]))


def test_cli_trains_on_a_table_with_a_list_feature_equally_on_1_and_2_ranks(tmp_path):
    """The genres list (0..3 ids, mean-pooled, padded with -1) from Parquet through the
    memmap reader, trained by the CLI: one process, and 2 ranks row-wise with the broadcast
    loader, give the same losses and final evaluation."""
    src = write_parquet(tmp_path / "movies.parquet", movies(80))
    spec = write_spec(tmp_path / "spec.yaml", SPEC)
    preprocess_table(parse_spec(SPEC), [src], tmp_path / "bin", block_rows=8)
    common = (
        "data=table",
        f"data.path={tmp_path / 'bin'}",
        f"data.spec={spec}",
        "train.steps=4",
        "train.batch_size=8",
        "train.log_every=1",
        "eval.batch_size=8",
        "eval.batches=null",
        "optim.dense.name=sgd",
        "device=cpu",
    )
    runs = {}
    for name, extra in (
        ("one", ()),
        ("two", ("launcher.nproc_per_node=2", "sharding=row_wise", "data.loader=broadcast")),
    ):
        run = tmp_path / name
        out = run_cli(*common, *extra, f"hydra.run.dir={run}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    one, two = runs["one"], runs["two"]
    assert [r["step"] for r in one if "loss" in r and "auc" not in r][-1] == 4
    for key in ("loss", "auc"):
        a = [r[key] for r in one if key in r]
        b = [r[key] for r in two if key in r]
        assert len(a) == len(b) > 0 and a == pytest.approx(b, rel=1e-4, abs=1e-6), key
    bad = run_cli("data=table", f"data.path={tmp_path / 'bin'}", "model.hotness=2", cwd=tmp_path)
    assert (
        bad.returncode == 2
        and bad.stderr.startswith("hybridrec-train: model.hotness=2 contradicts the dataset")
        and bad.stderr.count("\n") == 1
    )


def test_a_model_whose_bags_differ_from_the_dataset_is_refused_at_open(table_dir):
    import dataclasses

    from hybridrec.data.manifest import Manifest
    from hybridrec.data.source import check_model_matches

    m = validate(compose(["data=table", f"data.path={table_dir}"])).model
    manifest = Manifest.load(table_dir)
    check_model_matches(manifest, m, "x")  # the filled model fits
    flat = dataclasses.replace(m, jagged=False)
    with pytest.raises(ValueError) as e:
        check_model_matches(manifest, flat, "x")
    assert str(e.value) == (
        "table genres: the dataset x holds 3 id column(s) (jagged: True) but the model has "
        "hotness 3, jagged False; use data=table, which takes them from the dataset"
    )


def test_final_split_scores_the_whole_test_split_as_the_last_row(tmp_path):
    """eval.final_split=test: after training, the whole test split (20 rows) once more, as
    the last metrics row, equal to evaluating the saved model on it (eval.only)."""
    src = write_parquet(tmp_path / "movies.parquet", movies(80))  # train 40, val 20, test 20
    preprocess_table(parse_spec(SPEC), [src], tmp_path / "bin", block_rows=8)
    common = (
        "data=table",
        f"data.path={tmp_path / 'bin'}",
        "train.batch_size=8",
        "eval.batch_size=8",
        "device=cpu",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    run = tmp_path / "run"
    out = run_cli(
        *common,
        "train.steps=3",
        "eval.every=2",
        "eval.batches=1",  # periodic evaluations read one batch; the final one the whole split
        "eval.final_split=test",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in rows if r["split"] != "train"] == [
        (2, "val"),
        (3, "val"),
        (3, "test"),
    ]
    final = rows[-1]
    assert final["eval_samples"] == 20 and rows[-2]["eval_samples"] == 8
    again = tmp_path / "again"
    out = run_cli(
        *common,
        "eval.only=true",
        "data.eval_split=test",
        "eval.batches=null",
        f"hydra.run.dir={again}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (want,) = [json.loads(line) for line in (again / "metrics.jsonl").read_text().splitlines()]
    assert want["step"] == 3 and want["eval_samples"] == 20
    for key in ("auc", "logloss", "accuracy"):
        assert final[key] == pytest.approx(want[key], rel=1e-6), key
    assert final["auc"] != rows[-2]["auc"] or final["logloss"] != rows[-2]["logloss"]


def test_final_split_needs_a_file_dataset_and_training(table_dir):
    with pytest.raises(ValueError, match="^eval.final_split='train' is not one of: val, test$"):
        validate(compose(["data=table", f"data.path={table_dir}", "eval.final_split=train"]))
    with pytest.raises(ValueError, match="^eval.final_split=test evaluates a split of a file"):
        validate(compose(["eval.final_split=test"]))
    with pytest.raises(ValueError, match="^eval.final_split runs after training; with eval.only"):
        validate(
            compose(
                [
                    "data=table",
                    f"data.path={table_dir}",
                    "eval.final_split=test",
                    "eval.only=true",
                    "checkpoint.dir=x",
                ]
            )
        )


def test_truncated_lists_give_at_most_max_len_ids_per_bag(tmp_path):
    """The manifest's mean list length is of the lists before truncation; the model's
    mean_ids (what the planner charges) is capped at max_len, so such a dataset trains."""
    d = spec_dict()
    d["sparse"][3]["max_len"] = 1  # genres: lists of 0..3, mean above 1
    src = write_parquet(tmp_path / "movies.parquet", movies())
    preprocess_table(parse_spec(d), [src], tmp_path / "bin", block_rows=8)
    m = validate(compose(["data=table", f"data.path={tmp_path / 'bin'}"])).model
    assert m.hotness == [1, 1, 1, 1] and m.mean_ids[3] == 1.0
