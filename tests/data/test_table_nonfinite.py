"""NaN and infinity in a table's numbers (docs/data-spec.md, Dense columns and Label): a NaN
dense value is a null, counted and stored as a null is (a standardized column is never
poisoned); an infinity, a value beyond float32, a NaN label and an infinite regression label
are refused in one line naming the column, the file and the rows."""

from __future__ import annotations

import numpy as np
import pytest

from hybridrec.data import open_dataset
from hybridrec.data.preprocess_cli import main as preprocess_main
from hybridrec.data.spec import parse_spec
from hybridrec.data.tabular import preprocess_table
from tests.data.tables import SPEC, movies, spec_dict, write_csv, write_parquet, write_spec


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_a_nan_is_a_null_and_poisons_nothing(tmp_path, fmt, capsys):
    """One NaN among the standardized ages (Parquet: a float NaN; CSV: the text 'nan') gives
    the dataset that an empty cell there gives, bit for bit, and the printed null count
    includes it."""
    write = write_parquet if fmt == "parquet" else write_csv
    with_nan, with_null = movies(), movies()
    assert with_nan["age"][2] is not None
    with_nan["age"][2] = float("nan")
    with_null["age"][2] = None
    spec = write_spec(tmp_path / "s.yaml", SPEC)
    for name, cols in (("nan", with_nan), ("null", with_null)):
        src = write(tmp_path / f"{name}.{fmt}", cols)
        argv = ["--spec", str(spec), "--input", str(src), "--output", str(tmp_path / name)]
        assert preprocess_main(argv) == 0
    printed = capsys.readouterr().out
    nulls = movies()["age"].count(None) + 1
    assert f"age: dense (standardize), 40 rows, {nulls} nulls (1 of them NaN)\n" in printed
    assert f"age: dense (standardize), 40 rows, {nulls} nulls\n" in printed
    a, b = open_dataset(tmp_path / "nan"), open_dataset(tmp_path / "null")
    assert np.isfinite(a.dense).all()
    np.testing.assert_array_equal(a.dense, b.dense)
    column = a.manifest.schema["dense"]["columns"][0]
    assert column["nulls"] == nulls and column["nans"] == 1
    assert column["train_mean"] == b.manifest.schema["dense"]["columns"][0]["train_mean"]


def _fails(tmp_path, cols: dict, spec: dict, fmt: str = "parquet") -> str:
    write = write_parquet if fmt == "parquet" else write_csv
    src = write(tmp_path / f"t.{fmt}", cols)
    with pytest.raises(ValueError) as e:
        preprocess_table(parse_spec(spec), [src], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert "\n" not in str(e.value)
    return str(e.value).replace(str(src), "t")


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_an_infinite_dense_value_is_refused_naming_the_rows(tmp_path, fmt):
    cols = movies()
    for i in (5, 30):
        cols["age"][i] = float("inf")
    cols["age"][12] = float("-inf")
    assert _fails(tmp_path, cols, SPEC, fmt) == (
        "dense column 'age' holds inf at t rows 6, 13, 31; a dense value is a finite number: "
        "replace it (a cap, or an empty cell for a missing value, which counts as a null)"
    )


def test_a_value_beyond_float32_is_refused(tmp_path):
    cols = movies()
    cols["age"][7] = 1e39
    d = spec_dict(dense=[{"column": "age", "transform": "none"}])
    assert _fails(tmp_path, cols, d) == (
        "dense column 'age' holds 1e+39 at t row 8, which is not finite in float32 after "
        "transform none; rescale the column or use transform: log1p or standardize"
    )


def test_nan_and_infinite_labels_are_refused_naming_the_rows(tmp_path):
    cols = movies()
    cols["score"] = [float(r) for r in cols["rating"]]
    cols["score"][3] = float("nan")
    regression = spec_dict(label={"column": "score", "task": "regression"})
    assert _fails(tmp_path, cols, regression) == (
        "label column 'score' holds NaN at t row 4; a regression label is a finite number: "
        "fix or drop such rows"
    )
    cols["score"][3] = 2.0
    cols["score"][9] = cols["score"][11] = float("-inf")
    assert _fails(tmp_path, cols, regression) == (
        "label column 'score' holds -inf at t rows 10, 12; a regression label is a finite "
        "number: fix or drop such rows"
    )
    cols["score"][9] = cols["score"][11] = 3.0
    cols["score"][20] = float("nan")
    rule = spec_dict(label={"column": "score", "task": "binary", "rule": {"op": ">=", "value": 4}})
    assert _fails(tmp_path, cols, rule) == (
        "label column 'score' holds NaN at t row 21, which the rule cannot compare; every row "
        "needs a label: fix or drop such rows"
    )
    cols["score"] = [float(r >= 4) for r in cols["rating"]]
    cols["score"][20] = float("nan")
    binary = spec_dict(label={"column": "score", "task": "binary"})
    assert _fails(tmp_path, cols, binary) == (
        "label column 'score' holds NaN at t row 21; a binary label is 0 or 1: give a rule "
        "(label.rule: {op: '>=', value: 4}) or task: regression"
    )


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_a_regression_label_beyond_float32_is_refused(tmp_path, fmt):
    """1e39 is finite in the input but float32 inf once stored: refused naming the row, as a
    dense value is (it used to be stored as inf, and training then stopped with 'loss became
    NaN or inf ... lower the learning rates')."""
    cols = movies()
    cols["score"] = [float(r) for r in cols["rating"]]
    cols["score"][6] = 1e39
    cols["score"][17] = -1e39
    regression = spec_dict(label={"column": "score", "task": "regression"})
    assert _fails(tmp_path, cols, regression, fmt) == (
        "label column 'score' holds 1e+39 at t rows 7, 18, which is not finite in float32 "
        "(labels are stored as float32, |x| <= 3.4e38); rescale the label or fix or drop such "
        "rows"
    )


def test_a_nan_category_is_a_null_too(tmp_path):
    """A float column used as a sparse feature: NaN is the null id, in a single feature and
    inside a list, as None is (it was counted as a vocabulary value, then encoded as out of
    vocabulary: NaN != NaN)."""
    d = spec_dict()
    d["sparse"][2] = {"name": "zip", "column": "zip", "encoding": "vocabulary"}
    d["sparse"][3] = {"name": "genres", "column": "genres", "kind": "list"}
    datasets = []
    for name, missing in (("nan", float("nan")), ("null", None)):
        cols = movies()
        cols["zip"] = [missing if i % 4 == 0 else float(i % 3) for i in range(len(cols["zip"]))]
        cols["genres"] = [[1.5, missing, 2.5][: i % 4] for i in range(len(cols["zip"]))]
        src = write_parquet(tmp_path / f"{name}.parquet", cols)
        report = preprocess_table(parse_spec(d), [src], tmp_path / name)
        datasets.append((report.lines, open_dataset(tmp_path / name)))
    (lines_nan, a), (lines_null, b) = datasets
    np.testing.assert_array_equal(a.categorical, b.categorical)
    assert lines_nan == lines_null and "10 nulls" in lines_nan[4]
    assert a.manifest.features[2]["num_embeddings"] == 2 + 3  # 0.0, 1.0, 2.0: no NaN row
