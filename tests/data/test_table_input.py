"""The spec's `input` section: headerless CSV/TSV named by input.columns, a forced format and
delimiter read the same data as a header row does; wrong field counts and wrong keys are one
line naming the file and row (or the spec key)."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from hybridrec.data.dataset import open_dataset
from hybridrec.data.spec import load_spec, parse_spec
from hybridrec.data.tabular import preprocess_table
from tests.data.tables import SPEC, movies, spec_dict, write_csv, write_parquet, write_spec

COLUMNS = list(movies())  # rating, age, user, movie, zip, genres


def _arrays(path) -> list[np.ndarray]:
    ds = open_dataset(path)
    return [np.asarray(ds.labels), np.asarray(ds.dense), np.asarray(ds.categorical)]


def _headerless(src, dst):
    """The file without its header row (optionally gzip-compressed, by dst's name)."""
    body = src.read_bytes().split(b"\n", 1)[1]
    dst.write_bytes(gzip.compress(body) if dst.name.endswith(".gz") else body)
    return dst


def test_headerless_tsv_and_a_forced_format_read_the_same_as_a_header(tmp_path):
    cols = movies()
    with_header = write_csv(tmp_path / "m.tsv", cols, delimiter="\t")
    preprocess_table(parse_spec(SPEC), [with_header], tmp_path / "ref", block_rows=8)
    ref = _arrays(tmp_path / "ref")
    inp = {"header": False, "columns": COLUMNS}
    bare = _headerless(with_header, tmp_path / "bare.tsv")
    preprocess_table(parse_spec(spec_dict(input=inp)), [bare], tmp_path / "a", block_rows=8)
    # a day file: no suffix that names the format (gzip still read from .gz), another delimiter
    day = _headerless(write_csv(tmp_path / "m.csv", cols, delimiter=";"), tmp_path / "day_0.gz")
    forced = {**inp, "format": "csv", "delimiter": ";"}
    preprocess_table(parse_spec(spec_dict(input=forced)), [day], tmp_path / "b", block_rows=8)
    for out in ("a", "b"):
        got = _arrays(tmp_path / out)
        assert all(np.array_equal(x, y) for x, y in zip(got, ref, strict=True)), out
    assert ref[0].shape == (40,) and (ref[2][:, 3] >= 2).any()  # real ids, not all null


@pytest.mark.parametrize("header", [False, True])
@pytest.mark.parametrize("bad_row", [7, 30000])  # in the first block (schema) and much later
def test_a_row_with_the_wrong_number_of_fields_names_the_file_and_row(tmp_path, header, bad_row):
    cols = movies(40000)
    src = write_csv(tmp_path / "m.tsv", cols, delimiter="\t")
    if not header:
        src = _headerless(src, tmp_path / "bare.tsv")
    lines = src.read_text().split("\n")
    line = bad_row - 1 + header  # 0-based line of data row `bad_row`
    lines[line] = lines[line].rsplit("\t", 2)[0]  # drops two fields
    src.write_text("\n".join(lines))
    d = spec_dict() if header else spec_dict(input={"header": False, "columns": COLUMNS})
    with pytest.raises(ValueError) as e:
        preprocess_table(parse_spec(d), [src], tmp_path / "out", batch_rows=4096)
    names = "the header row has" if header else "the spec's input.columns names"
    assert str(e.value) == (
        f"{src} row {bad_row} has 4 fields but {names} 6: {lines[line]!r}; fix or remove the row"
    )
    assert not (tmp_path / "out").exists()


def test_input_applies_to_csv_only(tmp_path):
    src = write_parquet(tmp_path / "m.parquet", movies())
    with pytest.raises(ValueError) as e:
        preprocess_table(parse_spec(spec_dict(input={"delimiter": ";"})), [src], tmp_path / "o")
    assert str(e.value) == (
        f"the spec's input section applies to CSV/TSV inputs, but {src} is Parquet; remove "
        "input from the spec"
    )


def test_a_spec_without_input_keeps_its_fingerprint_and_records_none(tmp_path):
    """Datasets made before the input section exist: their spec's fingerprint (what
    data.spec and reruns compare) must not change, so an absent input is not recorded."""
    plain = parse_spec(spec_dict())
    assert "input" not in plain.to_dict()
    assert plain.fingerprint() == "2c92759014a1e73f"
    with_input = parse_spec(spec_dict(input={"header": False, "columns": COLUMNS}))
    assert with_input.to_dict()["input"] == {
        "format": None,
        "header": False,
        "columns": tuple(COLUMNS),
        "delimiter": None,
    }
    assert with_input.fingerprint() != plain.fingerprint()


@pytest.mark.parametrize(
    "inp,message",
    [
        (
            {"header": False},
            "input.columns is required with header: false: the name of every field, in order",
        ),
        (
            {"columns": ["a"]},
            "input.columns applies to header: false only (a header row names the columns)",
        ),
        (
            {"header": False, "columns": "a,b"},
            "input.columns must be a list of column names, one per field in file order",
        ),
        (
            {"header": False, "columns": ["a", 3]},
            "input.columns[1] must be a column name (a string), got 3",
        ),
        (
            {"header": False, "columns": ["a", "b", "a"]},
            "input.columns[2] repeats the name 'a'; names differ",
        ),
        ({"header": "no"}, "input.header must be bool, got 'no'"),
        ({"format": "parquet"}, "input.format='parquet' is not one of: csv, tsv"),
        ({"delimiter": "::"}, "input.delimiter must be one character, got '::'"),
        ({"skip": 1}, "input.skip is not a key of input; keys: format, header, columns, delimiter"),
        ([1], "input must be a mapping with keys format, header, columns, delimiter"),
    ],
)
def test_input_errors_name_the_file_and_key(tmp_path, inp, message):
    path = write_spec(tmp_path / "spec.yaml", spec_dict(input=inp))
    with pytest.raises(ValueError) as e:
        load_spec(path)
    assert str(e.value) == f"{path}: {message}"


def test_only_an_empty_field_is_null_in_csv(tmp_path):
    """As in Criteo's files: text such as NA or null is a value (NA is Namibia's country
    code), not a missing field; a number column holding it is an error naming the row."""
    cols = movies()
    cols["user"][:6] = ["NA", "NA", "null", None, "NA", "u1"]
    src = write_csv(tmp_path / "m.csv", cols)
    preprocess_table(parse_spec(SPEC), [src], tmp_path / "out", block_rows=8)
    user = np.asarray(open_dataset(tmp_path / "out").categorical)[:6, 0].tolist()
    assert user[3] == 0 and user[0] == user[1] == user[4] >= 2 and user[2] not in (0, user[0])
    cols["age"][2] = "NA"
    with pytest.raises(ValueError) as e:
        preprocess_table(parse_spec(SPEC), [write_csv(tmp_path / "b.csv", cols)], tmp_path / "b")
    assert (
        str(e.value) == f"dense column 'age' holds 'NA' at {tmp_path / 'b.csv'} row 3, not a number"
    )
