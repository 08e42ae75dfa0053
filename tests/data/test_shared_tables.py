"""Features sharing one table (a user id and the followed user ids): the spec accepts them when
they encode alike and refuses anything else in one line; preprocessing builds one vocabulary
over both features' train values, so a value gets the same id in both; the manifest and
data=table's model name every feature and the table it looks up."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from hybridrec.config import compose
from hybridrec.config.schema import ModelConfig
from hybridrec.data.dataset import open_dataset
from hybridrec.data.manifest import Manifest
from hybridrec.data.spec import load_spec, parse_spec
from hybridrec.data.table_model import dataset_model, fill_model
from hybridrec.data.tabular import preprocess_table
from tests.data.tables import (
    SHARED_SPEC,
    SPEC,
    follows,
    movies,
    vocab_ids,
    write_parquet,
    write_spec,
)

N_TRAIN = 20  # SHARED_SPEC splits by rows, train_fraction 0.5 of follows()' 40 rows


def _shared_spec(**sparse_changes: dict) -> dict:
    d = {**SHARED_SPEC, "sparse": [dict(s) for s in SHARED_SPEC["sparse"]]}
    for i, change in sparse_changes.items():
        d["sparse"][int(i[1:])].update(change)
    return d


@pytest.fixture
def shared(tmp_path):
    cols = follows()
    src = write_parquet(tmp_path / "follows.parquet", cols, row_group_size=7)
    report = preprocess_table(
        parse_spec(SHARED_SPEC), [src], tmp_path / "bin", block_rows=8, batch_rows=6
    )
    return cols, report, tmp_path / "bin"


# -- the spec ----------------------------------------------------------------------------------


def test_the_spec_accepts_features_sharing_a_table(tmp_path):
    spec = load_spec(write_spec(tmp_path / "spec.yaml", SHARED_SPEC))
    assert [(s.name, s.table) for s in spec.sparse] == [("user", "user"), ("followed", "user")]
    for enc in ({"encoding": "hashing", "cap": 50}, {"encoding": "identity", "rows": 9}):
        change = {**enc, "min_count": None}
        d = _shared_spec(s0=change, s1=change)
        for s in d["sparse"]:
            del s["min_count"]
        assert {s.encoding for s in parse_spec(d).sparse} == {enc["encoding"]}


@pytest.mark.parametrize(
    "first,second,shown",
    [
        (
            {"min_count": 2},
            {"min_count": 3},
            "user (vocabulary min_count=2) and followed (vocabulary min_count=3)",
        ),
        (
            {"min_count": 2},
            {"encoding": "hashing", "cap": 50},
            "user (vocabulary min_count=2) and followed (hashing cap=50)",
        ),
        (
            {"encoding": "hashing", "cap": 50},
            {"encoding": "hashing", "cap": 60},
            "user (hashing cap=50) and followed (hashing cap=60)",
        ),
        (
            {"encoding": "identity", "rows": 9},
            {"encoding": "identity", "rows": 10},
            "user (identity rows=9) and followed (identity rows=10)",
        ),
    ],
)
def test_features_sharing_a_table_must_encode_alike(tmp_path, first, second, shown):
    d = _shared_spec(s0=first, s1=second)
    for s in d["sparse"]:
        if s.get("encoding") in ("hashing", "identity"):
            del s["min_count"]
    path = write_spec(tmp_path / "spec.yaml", d)
    with pytest.raises(ValueError) as e:
        load_spec(path)
    assert str(e.value) == (
        f"{path}: features {shown} share table 'user' but encode differently; give every "
        "feature of one table the same encoding: vocabulary with one min_count, hashing with "
        "one cap, identity with one rows, or dynamic with one capacity and policy"
    )


# -- preprocessing -----------------------------------------------------------------------------


def test_one_vocabulary_over_both_features_gives_a_value_one_id(shared):
    cols, report, out = shared
    train = range(N_TRAIN)
    values = [cols["user"][i] for i in train] + [
        v for i in train for v in cols["followed"][i] or []
    ]
    vocab = vocab_ids(values, min_count=2)
    # "both" is seen once in each feature: kept only because min_count counts them together
    assert "both" in vocab and "rare" not in vocab and "u6" in vocab
    max_len = max(len(cols["followed"][i] or []) for i in train)
    want = []
    for u, f in zip(cols["user"], cols["followed"], strict=True):
        ids = [vocab.get(v, 1) for v in f or []][:max_len]
        want.append([0 if u is None else vocab.get(u, 1), *ids, *[-1] * (max_len - len(ids))])
    ds = open_dataset(out, verify="full")
    np.testing.assert_array_equal(ds.categorical, np.array(want))
    cat = np.asarray(ds.categorical)
    both = vocab["both"]
    assert cat[3, 0] == both and both in cat[6, 1:]  # the same row from either feature
    m = ds.manifest
    rows = 2 + len(vocab)  # the shared vocabulary's size
    assert [(f["name"], f["table"], f["num_embeddings"]) for f in m.features] == [
        ("user", "user", rows),
        ("followed", "user", rows),
    ]
    assert [f["shared_with"] for f in m.features] == [["followed"], ["user"]]
    assert [(t.name, t.field, t.num_embeddings) for t in m.tables] == [
        ("user", "user", rows),
        ("user", "followed", rows),
    ]
    assert m.hotness == [1, max_len]
    assert Manifest.from_dict(m.to_dict()).to_dict() == m.to_dict()
    # per feature: each id's train frequency in that feature
    for t, stats in enumerate(m.tables):
        with np.load(out / stats.counts_file) as z:
            got = dict(zip(z["ids"].tolist(), z["counts"].tolist(), strict=True))
        ids = cat[:N_TRAIN, 0:1] if t == 0 else cat[:N_TRAIN, 1:]
        used, n = np.unique(ids[ids >= 0], return_counts=True)
        assert got == dict(zip(used.tolist(), n.tolist(), strict=True))
    assert report.lines[2].startswith("user: strings, 40 rows, ")
    assert report.lines[2].endswith(f", table user (shared with followed; {rows} rows, width 8)")
    assert report.lines[3].endswith(f", table user (shared with user; {rows} rows, width 8)")


def test_shared_hashing_and_identity_give_equal_values_equal_ids(tmp_path):
    cols = {
        "clicked": [i % 2 == 0 for i in range(12)],
        "age": [float(i) for i in range(12)],
        "user": [i % 5 for i in range(12)],
        "followed": [[(i + k) % 5 for k in range(i % 3)] for i in range(12)],
    }
    src = write_parquet(tmp_path / "ints.parquet", cols)
    for enc in ({"encoding": "hashing", "cap": 1000}, {"encoding": "identity", "rows": 5}):
        d = _shared_spec(s0=enc, s1=enc)
        for s in d["sparse"]:
            del s["min_count"]
        out = tmp_path / enc["encoding"]
        preprocess_table(parse_spec(d), [src], out, block_rows=4)
        cat = np.asarray(open_dataset(out).categorical)
        id_of = {}
        for r in range(12):
            for v, i in zip([cols["user"][r], *cols["followed"][r]], cat[r][cat[r] >= 0]):
                assert id_of.setdefault(v, int(i)) == i, (enc, v)
        assert len(set(id_of.values())) == 5


def test_shared_columns_of_text_and_numbers_are_refused_in_one_line(tmp_path):
    cols = follows()
    cols["user"] = [None if u is None else len(u) for u in cols["user"]]
    src = write_parquet(tmp_path / "bad.parquet", cols)
    with pytest.raises(ValueError) as e:
        preprocess_table(parse_spec(SHARED_SPEC), [src], tmp_path / "out")
    assert str(e.value) == (
        "sparse[1] (followed): column 'followed' holds string values but feature user (column "
        "'user'), which shares table 'user', holds int64; one value must get one id in both: "
        "give the columns one type (cast one of them before preprocessing)"
    )
    assert not (tmp_path / "out").exists()
    hashing = {"encoding": "hashing", "cap": 1000}
    d = _shared_spec(s0=hashing, s1=hashing)
    for s in d["sparse"]:
        del s["min_count"]
    cols["followed"] = [[float(len(v)) for v in f or []] for f in cols["followed"]]
    src = write_parquet(tmp_path / "floats.parquet", cols)
    with pytest.raises(ValueError) as e:  # hashing: 5.0 by its repr, 5 as an int64
        preprocess_table(parse_spec(d), [src], tmp_path / "out")
    assert str(e.value).startswith(
        "sparse[1] (followed): column 'followed' holds double values but feature user (column "
        "'user'), which shares table 'user', holds int64;"
    )
    preprocess_table(parse_spec(SHARED_SPEC), [src], tmp_path / "out")  # a vocabulary: 5 == 5.0
    cat = np.asarray(open_dataset(tmp_path / "out").categorical)
    assert cols["user"][1] == 2 and cols["followed"][1] == [2.0] and cat[1, 0] == cat[1, 1] > 1


def test_rows_too_small_for_a_shared_vocabulary_name_both_features(tmp_path):
    src = write_parquet(tmp_path / "f.parquet", follows())
    d = {**SHARED_SPEC, "tables": [{"name": "user", "width": 8, "rows": 4}]}
    with pytest.raises(ValueError) as e:
        preprocess_table(parse_spec(d), [src], tmp_path / "out")
    assert str(e.value) == (
        "tables: user.rows=4 is too small: features user, followed (vocabulary) need 10 rows; "
        "raise it or leave it out"
    )
    d["tables"][0]["rows"] = 30
    preprocess_table(parse_spec(d), [src], tmp_path / "out")
    assert [f["num_embeddings"] for f in Manifest.load(tmp_path / "out").features] == [30, 30]


# -- the model of data=table -------------------------------------------------------------------


def test_the_model_names_each_feature_and_the_table_it_looks_up(shared):
    _, _, out = shared
    m = Manifest.load(out)
    rows = m.features[0]["num_embeddings"]
    keys = dataset_model(m)
    assert keys["feature_names"] == ["user", "followed"]
    assert keys["table_names"] == ["user", "user"]
    assert keys["num_embeddings_per_feature"] == [rows, rows]
    assert keys["embedding_dims"] == [8, 8] and keys["hotness"] == [1, 3]
    raw = fill_model(compose(["data=table", f"data.path={out}"]))
    model = OmegaConf.to_container(raw.model)
    assert model["feature_names"] == ["user", "followed"]
    assert model["table_names"] == ["user", "user"]
    fields = ModelConfig.__dataclass_fields__
    tables = ModelConfig(**{k: v for k, v in model.items() if k in fields}).tables()
    assert [(t.name, t.storage, t.table_name, t.num_rows) for t in tables] == [
        ("user", None, "user", rows),
        ("followed", "user", "user", rows),
    ]


def test_a_dataset_without_shared_tables_fills_what_it_did_plus_feature_names(tmp_path):
    src = write_parquet(tmp_path / "movies.parquet", movies())
    preprocess_table(parse_spec(SPEC), [src], tmp_path / "bin", block_rows=8)
    m = Manifest.load(tmp_path / "bin")
    assert all("shared_with" not in f for f in m.features)  # the records of before
    assert [t.counts_file for t in m.tables] == [
        f"counts/{t}.npz" for t in ("user", "movie", "zip", "genres")
    ]
    keys = dataset_model(m)
    assert keys["feature_names"] == keys["table_names"] == ["user", "movie", "zip", "genres"]
    raw = fill_model(compose(["data=table", f"data.path={tmp_path / 'bin'}"]))
    model = OmegaConf.to_container(raw.model)
    fields = ModelConfig.__dataclass_fields__
    tables = ModelConfig(**{k: v for k, v in model.items() if k in fields}).tables()
    assert [t.storage for t in tables] == [None] * 4  # each feature its own table, as before
