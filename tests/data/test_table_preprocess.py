"""hybridrec-preprocess --spec: Parquet and CSV tables -> the binary dataset format, every id
checked against a plain-Python reference, read back through the readers Criteo uses."""

from __future__ import annotations

import gzip
import math

import numpy as np
import pytest

from hybridrec.data.dataset import open_dataset
from hybridrec.data.manifest import Manifest
from hybridrec.data.preprocess_cli import main as preprocess_main
from hybridrec.data.source import BinarySource
from hybridrec.data.spec import parse_spec
from hybridrec.data.tabular import preprocess_table
from hybridrec.data.tabular.encode import splitmix64
from tests.data.tables import (
    SPEC,
    N,
    movies,
    spec_dict,
    vocab_ids,
    write_csv,
    write_parquet,
    write_spec,
)


def _expected(cols: dict[str, list], order: list[int], n_train_rows: list[int], max_len: int):
    """labels, dense, ids of `order` (row indices, output order) by the rules of the docs."""
    train = set(n_train_rows)
    user_vocab = vocab_ids([cols["user"][i] for i in n_train_rows], min_count=2)
    genre_vocab = vocab_ids([g for i in n_train_rows for g in (cols["genres"][i] or [])])
    ages = [cols["age"][i] or 0.0 for i in n_train_rows]
    mean = sum(ages) / len(ages)
    std = math.sqrt(sum((a - mean) ** 2 for a in ages) / len(ages))
    labels, dense, ids = [], [], []
    for i in order:
        labels.append(float(cols["rating"][i] >= 4))
        dense.append((((cols["age"][i] or 0.0) - mean) / std,))
        u = cols["user"][i]
        row = [0 if u is None else user_vocab.get(u, 1)]
        m = cols["movie"][i]
        row.append(13 if m is None else m)
        z = cols["zip"][i]
        zid = 0 if z is None else 1 + int(splitmix64(np.array([z], np.uint64))[0] % np.uint64(999))
        row.append(zid)
        g = [genre_vocab.get(x, 1) for x in (cols["genres"][i] or [])][:max_len]
        row += g + [-1] * (max_len - len(g))
        ids.append(row)
    assert train  # the reference needs train rows
    return (
        np.array(labels, np.float32),
        np.array(dense, np.float32),
        np.array(ids, np.int64),
    )


def _check(out, cols, order, train_rows):
    ds = open_dataset(out, verify="full")
    max_len = max(len(cols["genres"][i] or []) for i in train_rows)
    labels, dense, ids = _expected(cols, order, train_rows, max_len)
    assert ds.labels.dtype == np.float32 and ds.categorical.dtype == np.int32
    np.testing.assert_array_equal(ds.labels, labels)
    np.testing.assert_allclose(ds.dense, dense, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ds.categorical, ids)
    return ds


def test_parquet_file_every_encoding_nulls_and_rows_split(tmp_path):
    cols = movies()
    src = write_parquet(tmp_path / "movies.parquet", cols, row_group_size=7)
    report = preprocess_table(parse_spec(SPEC), [src], tmp_path / "out", block_rows=8, batch_rows=6)
    train = list(range(N // 2))
    ds = _check(tmp_path / "out", cols, list(range(N)), train)
    assert ds.manifest.splits == {"train": [0, 20], "val": [20, 30], "test": [30, 40]}
    m = ds.manifest
    assert [t.name for t in m.tables] == ["user", "movie", "zip", "genres"]
    assert [t.num_embeddings for t in m.tables] == [2 + 5, 14, 1000, 2 + 5]
    assert m.hotness == [1, 1, 1, 3] and m.features[3]["jagged"] is True
    assert Manifest.from_dict(m.to_dict()).to_dict() == m.to_dict()
    genres = [cols["genres"][i] for i in range(N)]
    lengths = [len(g or []) for g in genres]
    assert m.features[3]["nulls"] == sum(g is None for g in genres)
    assert m.features[3]["length"] == {"min": 0, "mean": sum(lengths) / N, "max": max(lengths)}
    assert m.features[0]["nulls"] == sum(u is None for u in cols["user"])
    # train frequencies of every id (the null id and the out-of-vocabulary id included)
    with np.load(tmp_path / "out" / "counts" / "user.npz") as z:
        got = dict(zip(z["ids"].tolist(), z["counts"].tolist(), strict=True))
    want = {}
    for i in train:
        want[int(ds.categorical[i, 0])] = want.get(int(ds.categorical[i, 0]), 0) + 1
    assert got == want
    assert report.lines[-1] == (
        f"genres: list of strings, {N} rows, 5 distinct, {m.features[3]['nulls']} nulls, "
        f"length 0..3 (mean {sum(lengths) / N:.1f}), table genres (7 rows, width 8)"
    )
    assert report.lines[1] == f"age: dense (standardize), {N} rows, {cols['age'].count(None)} nulls"


def test_read_back_through_binary_source_pads_short_lists_with_minus_one(tmp_path):
    cols = movies()
    src = write_parquet(tmp_path / "movies.parquet", cols)
    preprocess_table(parse_spec(SPEC), [src], tmp_path / "out", block_rows=8)
    source = BinarySource(open_dataset(tmp_path / "out"), shuffle=False)
    batch = source.batch(0, 20, "train")
    g = batch.ids[:, 3:].numpy()
    lengths = [len(cols["genres"][i] or []) for i in range(20)]
    for r, n in enumerate(lengths):
        assert (g[r, :n] >= 0).all() and (g[r, n:] == -1).all(), (r, g[r])
    assert batch.labels.dtype.is_floating_point and batch.ids.shape == (20, 6)


def test_parquet_directory_equals_the_same_rows_in_one_file(tmp_path):
    cols = movies()
    half = {k: v[:20] for k, v in cols.items()}, {k: v[20:] for k, v in cols.items()}
    write_parquet(tmp_path / "d" / "part-2.parquet", half[1])
    write_parquet(tmp_path / "d" / "part-1.parquet", half[0])
    (tmp_path / "d" / "_SUCCESS").write_text("")
    preprocess_table(parse_spec(SPEC), [tmp_path / "d"], tmp_path / "out")
    _check(tmp_path / "out", cols, list(range(N)), list(range(20)))


def test_hive_partitions_split_by_column(tmp_path):
    cols = movies()
    for day, rows in (
        (1, range(0, 24)),
        (2, range(24, 32)),
        (3, range(32, 36)),
        (4, range(36, 40)),
    ):
        part = {k: [v[i] for i in rows] for k, v in cols.items()}
        write_parquet(tmp_path / "h" / f"day={day}" / "p.parquet", part)
    split = {"by": "column", "column": "day", "values": {"train": 1, "val": [2], "test": [3]}}
    m = preprocess_table(parse_spec(spec_dict(split=split)), [tmp_path / "h"], tmp_path / "out")
    assert m.manifest.splits == {"train": [0, 24], "val": [24, 32], "test": [32, 36]}
    assert m.manifest.skipped_rows == 4  # day 4 is in no split: dropped
    _check(tmp_path / "out", cols, list(range(36)), list(range(24)))


def test_csv_with_a_delimited_list_column_and_int_categoricals(tmp_path):
    cols = movies()
    src = write_csv(tmp_path / "movies.csv", cols)
    d = spec_dict()
    d["sparse"][2] = {"name": "zip", "column": "zip", "encoding": "vocabulary"}
    preprocess_table(parse_spec(d), [src], tmp_path / "out", batch_rows=9)
    ds = open_dataset(tmp_path / "out")
    zips = vocab_ids(
        [str(cols["zip"][i]) if cols["zip"][i] is not None else None for i in range(20)]
    )
    want = [0 if z is None else zips.get(str(z), 1) for z in cols["zip"]]
    assert ds.categorical[:, 2].tolist() == want
    # in Parquet the zips are ints, counted and ordered as ints
    preprocess_table(parse_spec(d), [write_parquet(tmp_path / "z.parquet", cols)], tmp_path / "z")
    zips = vocab_ids(cols["zip"][:20])
    want = [0 if z is None else zips.get(z, 1) for z in cols["zip"]]
    assert open_dataset(tmp_path / "z").categorical[:, 2].tolist() == want
    assert open_dataset(tmp_path / "z").manifest.features[2]["values"] == "int64"
    # the same table in Parquet gives the same ids for every other column
    pq_src = write_parquet(tmp_path / "movies.parquet", cols)
    preprocess_table(parse_spec(SPEC), [pq_src], tmp_path / "pq")
    other = open_dataset(tmp_path / "pq")
    keep = [0, 1, 3, 4, 5]
    np.testing.assert_array_equal(ds.categorical[:, keep], other.categorical[:, keep])
    np.testing.assert_array_equal(ds.labels, other.labels)
    np.testing.assert_allclose(ds.dense, other.dense, rtol=1e-6)


def test_gzip_csv_and_hive_partitioned_csv(tmp_path):
    cols = movies()
    plain = write_csv(tmp_path / "m.csv", cols)
    (tmp_path / "m.csv.gz").write_bytes(gzip.compress(plain.read_bytes()))
    preprocess_table(parse_spec(SPEC), [tmp_path / "m.csv.gz"], tmp_path / "gz")
    preprocess_table(parse_spec(SPEC), [plain], tmp_path / "plain")
    a, b = open_dataset(tmp_path / "gz"), open_dataset(tmp_path / "plain")
    np.testing.assert_array_equal(a.categorical, b.categorical)
    for day, (lo, hi) in ((1, (0, 30)), (2, (30, 40))):
        write_csv(tmp_path / "h" / f"day={day}" / "p.csv", {k: v[lo:hi] for k, v in cols.items()})
    split = {"by": "column", "column": "day", "values": {"train": "1", "val": [2]}}
    m = preprocess_table(parse_spec(spec_dict(split=split)), [tmp_path / "h"], tmp_path / "hive")
    assert m.manifest.splits == {"train": [0, 30], "val": [30, 40], "test": [40, 40]}


def _fnv_splitmix(text: str) -> int:
    """The documented text hash, byte by byte in plain Python."""
    m = (1 << 64) - 1
    h = 0xCBF29CE484222325
    for b in text.encode():
        h = ((h ^ b) * 0x100000001B3) & m
    z = (h + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


@pytest.mark.parametrize("kind", ["single", "list"])
def test_hashing_text_matches_the_documented_hash(tmp_path, kind):
    cols = movies()
    cols["user"][7] = "ünïcode, longer than the others"
    d = spec_dict()
    if kind == "single":
        d["sparse"][0] = {"name": "user", "column": "user", "encoding": "hashing", "cap": 97}
        values = [[u] for u in cols["user"]]
    else:
        d["sparse"][3] = {
            "name": "genres",
            "column": "genres",
            "kind": "list",
            "encoding": "hashing",
            "cap": 97,
        }
        values = [g or [] for g in cols["genres"]]
    src = write_parquet(tmp_path / "t.parquet", cols)
    preprocess_table(parse_spec(d), [src], tmp_path / "out", batch_rows=7)
    ds = open_dataset(tmp_path / "out")
    col = 0 if kind == "single" else slice(3, None)
    for r, vs in enumerate(values):
        want = [0 if v is None else 1 + _fnv_splitmix(v) % 96 for v in vs]
        got = np.atleast_1d(ds.categorical[r, col]).tolist()
        assert got[: len(want)] == want and all(x == -1 for x in got[len(want) :]), r


def test_tsv_and_a_custom_list_delimiter(tmp_path):
    cols = movies()
    src = write_csv(tmp_path / "movies.tsv", cols, delimiter="\t", lists=";")
    d = spec_dict()
    d["sparse"][3]["delimiter"] = ";"
    preprocess_table(parse_spec(d), [src], tmp_path / "out")
    pq_src = write_parquet(tmp_path / "movies.parquet", cols)
    preprocess_table(parse_spec(SPEC), [pq_src], tmp_path / "pq")
    np.testing.assert_array_equal(
        open_dataset(tmp_path / "out").categorical[:, 3:],
        open_dataset(tmp_path / "pq").categorical[:, 3:],
    )


def test_fraction_split_is_seeded_per_row_and_independent_of_batching(tmp_path):
    cols = movies()
    src = write_parquet(tmp_path / "movies.parquet", cols)
    split = {"by": "fraction", "val": 0.25, "test": 0.25, "seed": 7}
    spec = parse_spec(spec_dict(split=split))
    u = np.random.default_rng(7).random(N)
    code = np.where(u < 0.25, 1, np.where(u < 0.5, 2, 0))
    order = [i for c in (0, 1, 2) for i in range(N) if code[i] == c]
    train = [i for i in range(N) if code[i] == 0]
    for batch_rows in (5, 1000):
        out = tmp_path / f"out{batch_rows}"
        preprocess_table(spec, [src], out, batch_rows=batch_rows)
        ds = _check(out, cols, order, train)
        assert ds.manifest.splits["val"] == [len(train), len(train) + int((code == 1).sum())]


def test_lists_longer_than_max_len_are_truncated_and_counted(tmp_path):
    cols = movies()
    src = write_parquet(tmp_path / "movies.parquet", cols)
    d = spec_dict()
    d["sparse"][3]["max_len"] = 2
    report = preprocess_table(parse_spec(d), [src], tmp_path / "out")
    f = report.manifest.features[3]
    assert f["max_len"] == 2 and f["hotness"] == 2
    assert f["truncated"] == sum(len(g or []) > 2 for g in cols["genres"])
    assert f", {f['truncated']} truncated to 2," in report.lines[-1]
    _check_first_ids = open_dataset(tmp_path / "out").categorical[:, 3:]
    full = tmp_path / "full"
    preprocess_table(parse_spec(SPEC), [src], full)
    np.testing.assert_array_equal(_check_first_ids, open_dataset(full).categorical[:, 3:5])


def test_regression_label_and_log1p(tmp_path):
    cols = movies()
    src = write_parquet(tmp_path / "movies.parquet", cols)
    label = {"column": "rating", "task": "regression"}
    dense = [{"column": "age", "transform": "log1p"}]
    preprocess_table(parse_spec(spec_dict(label=label, dense=dense)), [src], tmp_path / "out")
    ds = open_dataset(tmp_path / "out")
    assert ds.labels.tolist() == [float(r) for r in cols["rating"]]
    want = [math.log1p(a or 0.0) for a in cols["age"]]
    np.testing.assert_allclose(ds.dense[:, 0], want, rtol=1e-6)
    assert ds.manifest.schema["labels"]["task"] == "regression"


def test_cli_prints_one_line_per_feature_and_reruns_are_up_to_date(tmp_path, capsys):
    cols = movies()
    src = write_parquet(tmp_path / "movies.parquet", cols)
    spec = write_spec(tmp_path / "spec.yaml", SPEC)
    args = ["--spec", str(spec), "--input", str(src), "--output", str(tmp_path / "out")]
    assert preprocess_main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:6]] == [
        "rating",
        "age",
        "user",
        "movie",
        "zip",
        "genres",
    ]
    assert out[-1].startswith(f"wrote {tmp_path / 'out'}: 40 rows (train 20, val 10, test 10)")
    assert preprocess_main(args) == 0
    assert "up to date" in capsys.readouterr().out
    write_spec(tmp_path / "spec.yaml", spec_dict(split={"by": "rows", "train_fraction": 0.6}))
    assert preprocess_main(args) == 2  # the command is wrong: exit 2, as hybridrec-train
    assert "pass --overwrite" in capsys.readouterr().err
    assert preprocess_main([*args, "--overwrite"]) == 0
    assert open_dataset(tmp_path / "out").manifest.splits["train"] == [0, 24]
    assert preprocess_main([*args, "--encoding", "vocab"]) == 2
    assert capsys.readouterr().err == (
        "hybridrec-preprocess: error: --encoding applies to raw Criteo files; with --spec the "
        "spec sets it\n"
    )


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_an_empty_train_split_is_an_error(tmp_path, fmt):
    cols = movies()
    write = write_parquet if fmt == "parquet" else write_csv
    src = write(tmp_path / f"m.{fmt}", cols)
    split = {"by": "column", "column": "movie", "values": {"train": [99], "val": [1]}}
    with pytest.raises(ValueError, match="no rows in the train split"):
        preprocess_table(parse_spec(spec_dict(split=split)), [src], tmp_path / "out")
    assert not (tmp_path / "out").exists()
