"""Bad specs and bad tables: one line naming the key, column, file and row, and no output left."""

from __future__ import annotations

import datetime
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrec.data.preprocess_cli import main as preprocess_main
from hybridrec.data.spec import load_spec, parse_spec
from hybridrec.data.tabular import preprocess_table
from tests.data.tables import SPEC, movies, spec_dict, write_csv, write_parquet, write_spec


def _fails(tmp_path, cols_or_src, spec: dict, fmt: str = "parquet") -> str:
    if isinstance(cols_or_src, dict):
        write = write_parquet if fmt == "parquet" else write_csv
        src = write(tmp_path / f"t.{fmt}", cols_or_src)
    else:
        src = cols_or_src
    with pytest.raises(ValueError) as e:
        preprocess_table(parse_spec(spec), [src], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # a failed run leaves nothing behind
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_missing_column_lists_the_available_ones(tmp_path):
    d = spec_dict()
    d["sparse"][0]["column"] = "usr"
    msg = _fails(tmp_path, movies(), d)
    assert msg == (
        f"{tmp_path / 't.parquet'}: column 'usr' (spec sparse[0] (user).column) is not in the "
        "data; its columns: rating, age, user, movie, zip, genres"
    )


def test_strings_in_an_identity_column_name_the_row(tmp_path):
    cols = movies()
    cols["movie"] = [str(m) if m is not None else None for m in cols["movie"]]
    cols["movie"][12] = "Heat"
    msg = _fails(tmp_path, cols, SPEC, fmt="csv")
    assert msg == (
        f"sparse[1] (movie): column 'movie' holds the string 'Heat' at {tmp_path / 't.csv'} "
        "row 13; encoding: identity needs integer ids: use encoding: vocabulary or hashing for "
        "strings"
    )
    msg = _fails(tmp_path, cols, SPEC)  # a string column in Parquet: the same
    assert msg.startswith("sparse[1] (movie): column 'movie' holds the string 'Heat' at ")
    cols["movie"] = [float(i) + 0.5 for i in range(len(cols["movie"]))]
    msg = _fails(tmp_path, cols, SPEC)
    assert msg.startswith(
        f"sparse[1] (movie): column 'movie' holds 0.5 at {tmp_path / 't.parquet'} row 1;"
    )
    cols["movie"] = [True] * len(cols["movie"])
    msg = _fails(tmp_path, cols, SPEC)
    assert msg == (
        f"sparse[1] (movie): column 'movie' is of type bool in {tmp_path / 't.parquet'}; "
        "encoding: identity needs integer ids: use encoding: vocabulary or hashing"
    )


def test_identity_ids_outside_rows_name_the_row(tmp_path):
    cols = movies()
    cols["movie"][30] = 13
    msg = _fails(tmp_path, cols, SPEC)
    assert msg == (
        f"sparse[1] (movie): column 'movie' holds id 13 at {tmp_path / 't.parquet'} row 31, "
        "outside [0, rows=13); raise sparse[1].rows or use encoding: vocabulary"
    )


def test_identity_list_ids_name_the_row_of_the_bad_element(tmp_path):
    cols = movies()
    cols["tags"] = [[1, 2], [3], [], [4, -1], [0]] * 8
    d = spec_dict()
    d["sparse"][3] = {
        "name": "tags",
        "column": "tags",
        "kind": "list",
        "encoding": "identity",
        "rows": 5,
    }
    d["tables"][3]["name"] = "tags"
    msg = _fails(tmp_path, cols, d)
    assert msg.endswith(
        f"holds id -1 at {tmp_path / 't.parquet'} row 4, outside [0, rows=5); "
        "raise sparse[3].rows or use encoding: vocabulary"
    )


def test_a_list_where_a_scalar_is_declared_and_the_reverse(tmp_path):
    d = spec_dict()
    d["sparse"][3].pop("kind")
    d["sparse"][3].pop("pooling")
    msg = _fails(tmp_path, movies(), d)
    assert msg == (
        f"sparse[3] (genres): column 'genres' holds lists (list<element: string>) in "
        f"{tmp_path / 't.parquet'} but the spec declares kind: single; use kind: list"
    )
    d = spec_dict()
    d["sparse"][2]["kind"] = "list"
    msg = _fails(tmp_path, movies(), d)
    assert msg == (
        f"sparse[2] (zip): column 'zip' holds scalars (int64) in {tmp_path / 't.parquet'} but "
        "the spec declares kind: list; use kind: single, or store lists (or delimited strings)"
    )


def test_a_non_numeric_dense_column(tmp_path):
    cols = movies()
    cols["age"] = [str(a) if a is not None else None for a in cols["age"]]
    cols["age"][7] = "old"
    msg = _fails(tmp_path, cols, SPEC, fmt="csv")
    assert msg == f"dense column 'age' holds 'old' at {tmp_path / 't.csv'} row 8, not a number"
    cols["age"] = [datetime.date(2024, 1, 1)] * len(cols["age"])
    msg = _fails(tmp_path, cols, SPEC)
    assert msg == (
        f"dense column 'age' is of type date32[day] in {tmp_path / 't.parquet'}, not numeric: "
        "it takes integers, floats, booleans or decimals (CSV: numbers as text)"
    )


def test_labels_binary_without_a_rule_and_empty(tmp_path):
    d = spec_dict(label={"column": "rating"})
    msg = _fails(tmp_path, movies(), d)
    assert msg == (
        f"label column 'rating' holds 3 at {tmp_path / 't.parquet'} row 2; a binary label is 0 "
        "or 1: give a rule (label.rule: {op: '>=', value: 4}) or task: regression"
    )
    cols = movies()
    cols["rating"][5] = None
    msg = _fails(tmp_path, cols, SPEC)
    assert msg == (
        f"label column 'rating' is empty at {tmp_path / 't.parquet'} row 6; every row needs a label"
    )


def test_files_with_conflicting_types_name_the_file(tmp_path):
    cols = movies()
    write_parquet(tmp_path / "d" / "a.parquet", cols)
    other = dict(cols)
    other["movie"] = [f"m{i}" for i in range(len(cols["movie"]))]
    write_parquet(tmp_path / "d" / "b.parquet", other)
    msg = _fails(tmp_path, tmp_path / "d", SPEC)
    assert msg.startswith(f"{tmp_path / 'd' / 'b.parquet'}: cannot be read after row 0: ")


def test_inputs_of_unknown_or_mixed_formats(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    assert _fails(tmp_path, tmp_path / "x.json", SPEC) == (
        f"input {tmp_path / 'x.json'}: cannot tell its format from the name; name Parquet files "
        "*.parquet, CSV files *.csv, TSV files *.tsv"
    )
    write_parquet(tmp_path / "m" / "a.parquet", movies())
    write_csv(tmp_path / "m" / "b.csv", movies())
    assert _fails(tmp_path, tmp_path / "m", SPEC).startswith("the inputs mix formats: parquet")


def test_cli_reports_bad_data_in_one_line(tmp_path, capsys):
    cols = movies()
    cols["movie"][30] = 99
    src = write_parquet(tmp_path / "t.parquet", cols)
    spec = write_spec(tmp_path / "s.yaml", SPEC)
    rc = preprocess_main(
        ["--spec", str(spec), "--input", str(src), "--output", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        "hybridrec-preprocess: error: sparse[1] (movie): column 'movie' holds id 99"
    )


def test_nested_columns_are_one_line_naming_what_the_spec_takes(tmp_path, capsys):
    """A list of lists, a struct, a list of structs, a map: refused before any row is read
    (exit 2, as the spec must change), never pyarrow's 27-line ArrowNotImplementedError."""
    spec = write_spec(tmp_path / "s.yaml", SPEC)
    n = len(movies()["genres"])
    sparse = "strings, integers, floats, booleans, decimals or dates"
    cases = {
        "genres": (
            [[["drama"], ["x"]]] * n,
            "list<element: list<element: string>>, lists of lists; a sparse feature takes one "
            f"value (kind: single) or one flat list (kind: list) per row, of {sparse}: flatten "
            "the column, or give each inner list a column of its own",
        ),
        "user": (
            [{"a": 1}] * n,
            f"struct<a: int64>; sparse[0] (user) takes {sparse} (kind: single) or lists of "
            "them (kind: list): move the field you need into a column of its own",
        ),
        "zip": (
            pa.array([[("k", 1)]] * n, pa.map_(pa.string(), pa.int64())),
            f"map<string, int64 ('zip')>; sparse[2] (zip) takes {sparse} (kind: single) or lists of "
            "them (kind: list): move the field you need into a column of its own",
        ),
        "age": (
            [[1.0, 2.0]] * n,
            "list<element: double>; dense[0] takes one number per row: a list column can be a "
            "sparse feature (kind: list)",
        ),
    }
    keys = {"genres": "sparse[3] (genres)", "user": "sparse[0] (user)", "zip": "sparse[2] (zip)"}
    for column, (values, why) in cases.items():
        cols = movies()
        cols[column] = values
        src = write_parquet(tmp_path / f"{column}.parquet", cols)
        argv = ["--spec", str(spec), "--input", str(src), "--output", str(tmp_path / "o")]
        assert preprocess_main(argv) == 2
        err = capsys.readouterr().err
        key = keys.get(column, "dense[0]")
        assert err == (
            f"hybridrec-preprocess: error: {src}: column {column!r} (spec {key}.column) holds "
            f"{why}\n"
        )
        assert not (tmp_path / "o").exists()
    cols = movies()
    cols["genres"] = [[{"name": "drama"}]] * n
    with pytest.raises(ValueError, match=r"list<element: struct<name: string>>, lists of struct"):
        preprocess_table(load_spec(spec), [write_parquet(tmp_path / "t.parquet", cols)], tmp_path)


# -- the spec itself ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda d: d["sparse"][0].update(encoding="bag"),
            "sparse[0] (user).encoding='bag' is not one of: vocabulary, hashing, identity, dynamic",
        ),
        (
            lambda d: d["sparse"][2].pop("cap"),
            "sparse[2] (zip).cap is required with encoding: hashing",
        ),
        (
            lambda d: d["sparse"][1].update(min_count=3),
            "sparse[1] (movie).min_count applies to encoding: vocabulary or dynamic, not identity",
        ),
        (
            lambda d: d["sparse"][0].update(max_len=3),
            "sparse[0] (user).max_len applies to kind: list only",
        ),
        (
            lambda d: (d["sparse"][1].update(table="user"), d["tables"].pop(1)),
            "features user (vocabulary min_count=2) and movie (identity rows=13) share table "
            "'user' but encode differently; give every feature of one table the same encoding: "
            "vocabulary with one min_count, hashing with one cap, identity with one rows, or dynamic "
            "with one capacity and policy",
        ),
        (
            lambda d: d["tables"].pop(),
            "sparse[3] (genres) uses table 'genres', which tables does not "
            "list; add {name: genres, width: 16} to tables",
        ),
        (
            lambda d: d["tables"].append({"name": "x", "width": 4}),
            "tables lists 'x', which no sparse feature uses",
        ),
        (
            lambda d: d["label"].update(task="regression"),
            "label.rule makes a binary label; it does not apply to task: regression",
        ),
        (
            lambda d: d["label"]["rule"].update(op="~"),
            "label.rule.op='~' is not one of: ==, !=, >, >=, <, <=",
        ),
        (
            lambda d: d["dense"][0].update(transform="log"),
            "dense[0].transform='log' is not one of: none, log1p, standardize",
        ),
        (lambda d: d["tables"][0].update(width=0), "tables[0].width must be >= 1, got 0"),
        (lambda d: d["tables"][0].update(width="8"), "tables[0].width must be int, got '8'"),
        (
            lambda d: d.update(split={"by": "fraction", "val": 0.6, "test": 0.5}),
            "split.val and split.test must be >= 0 with val + test < 1, got 0.6, 0.5",
        ),
        (
            lambda d: d.update(split={"by": "rows", "val": 0.1}),
            "split.val does not apply to split by: rows (its keys: train_fraction)",
        ),
        (
            lambda d: d.update(
                split={"by": "column", "column": "d", "values": {"train": [1], "val": [1]}}
            ),
            "split.values.val repeats 1, already in split train",
        ),
        (lambda d: d.update(sparse=[]), "sparse must list at least one categorical or list column"),
        (
            lambda d: d.update(features=[]),
            "features is not a spec key; keys: label, dense, sparse, tables, split, input",
        ),
        (
            lambda d: d["sparse"][0].update(colour=1),
            "sparse[0].colour is not a key of sparse[0]; keys: name, column, kind, encoding, min_count, "
            "cap, rows, capacity, policy, table, pooling, max_len, delimiter",
        ),
    ],
)
def test_spec_errors_name_the_file_and_key(tmp_path, change, message):
    d = spec_dict()
    change(d)
    path = write_spec(tmp_path / "spec.yaml", d)
    with pytest.raises(ValueError) as e:
        load_spec(path)
    assert str(e.value) == f"{path}: {message}"


def test_spec_defaults_and_fingerprint(tmp_path):
    s = load_spec(write_spec(tmp_path / "a.yaml", SPEC))
    user = s.sparse[0]
    assert (user.kind, user.table, user.pooling, user.delimiter) == ("single", "user", "sum", "|")
    assert s.fingerprint() == parse_spec(spec_dict()).fingerprint()
    d = spec_dict()
    d["tables"][0]["width"] = 16
    assert parse_spec(d).fingerprint() != s.fingerprint()
    (tmp_path / "bad.yaml").write_text("label: [unclosed")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'bad.yaml'}: not valid YAML")):
        load_spec(tmp_path / "bad.yaml")


def test_a_table_smaller_than_its_feature_needs(tmp_path):
    d = spec_dict()
    d["tables"][1]["rows"] = 10
    msg = _fails(tmp_path, movies(), d)
    assert msg == (
        "tables: movie.rows=10 is too small: feature movie (identity) needs 14 rows; raise it or "
        "leave it out"
    )


def test_pandas_style_dictionary_and_nullable_float_columns(tmp_path):
    """pandas categoricals arrive as dictionaries; ints with nulls as floats: both work."""
    cols = movies()
    t = pa.table(cols)
    t = t.set_column(2, "user", pa.compute.dictionary_encode(t.column("user")))
    t = t.set_column(3, "movie", t.column("movie").cast(pa.float64()))
    pq.write_table(t, tmp_path / "p.parquet")
    preprocess_table(parse_spec(SPEC), [tmp_path / "p.parquet"], tmp_path / "p")
    write_parquet(tmp_path / "q.parquet", cols)
    preprocess_table(parse_spec(SPEC), [tmp_path / "q.parquet"], tmp_path / "q")
    from hybridrec.data.dataset import open_dataset

    a, b = open_dataset(tmp_path / "p"), open_dataset(tmp_path / "q")
    assert (a.categorical == b.categorical).all()


def test_split_values_that_do_not_fit_the_column(tmp_path):
    split = {"by": "column", "column": "movie", "values": {"train": ["one"], "val": [2]}}
    msg = _fails(tmp_path, movies(), spec_dict(split=split))
    assert msg == "split.values.train: ['one'] cannot be compared with column 'movie' of type int64"
