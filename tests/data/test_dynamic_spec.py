"""encoding: dynamic in the dataset spec: raw int64 ids with no vocabulary pass (integers kept,
strings hashed stably), the policy in the manifest and in model.dynamic, one line per bad key."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest
from omegaconf import OmegaConf

from hybridrec import dynamic_policy
from hybridrec.config import compose
from hybridrec.configure import validate
from hybridrec.data.dataset import open_dataset
from hybridrec.data.manifest import Manifest
from hybridrec.data.preprocess_cli import main as preprocess_main
from hybridrec.data.spec import SPEC_POLICY_KEYS, parse_spec
from hybridrec.data.tabular import preprocess_table
from hybridrec.data.tabular.encode import DYNAMIC_NULL, raw_ids
from hybridrec.types import DYNAMIC_ADMIT, DYNAMIC_EVICT, DYNAMIC_UNKNOWN, Dynamic
from tests.data.tables import DYNAMIC_SPEC as SPEC
from tests.data.tables import dynamic_columns as _cols
from tests.data.tables import write_csv, write_parquet, write_spec

MASK = (1 << 64) - 1


def _reference_hash(text: str) -> int:
    """Plain Python: splitmix64(FNV-1a 64 of the UTF-8 bytes) mod (2^63 - 2)."""
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & MASK
    z = (h + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return (z ^ (z >> 31)) % DYNAMIC_NULL


def test_strings_hash_stably_and_plain_integers_stay_integers():
    words = ["alice", "", "bob", "ünïcode", "007", "-3", "12", "9223372036854775807", None]
    ids, bad = raw_ids(pa.array(words))
    assert bad is None and ids.dtype == np.int64
    want = [_reference_hash(w) for w in words[:5]] + [_reference_hash("-3"), 12]
    want += [_reference_hash("9223372036854775807"), DYNAMIC_NULL]  # too large: hashed
    assert ids.tolist() == want
    # a fixed value, so a change of the hash (which would orphan every trained row) fails here
    assert ids[0] == 1874745765387981941
    # the same string gets the same id whatever else is in its batch, and in any order
    again, _ = raw_ids(pa.array(["bob", "zed", "alice"] * 3, pa.large_string()))
    assert again[[0, 2]].tolist() == [ids[2], ids[0]]
    assert (ids[:-1] >= 0).all() and (ids[:-1] < DYNAMIC_NULL).all()


def test_the_spec_the_config_and_the_library_check_policies_with_one_dynamic():
    """Preprocessing runs without torch, so the policy's one home is torch-free
    (hybridrec.dynamic_policy): the spec's policy keys are its fields (but min_count, the
    feature's own key), and a value it refuses is refused by the spec and the config alike,
    each naming the key in its own terms."""
    assert Dynamic is dynamic_policy.Dynamic  # hybridrec.types re-exports it
    assert {"min_count", *SPEC_POLICY_KEYS} == {f.name for f in dataclasses.fields(Dynamic)}
    assert (DYNAMIC_ADMIT, DYNAMIC_EVICT, DYNAMIC_UNKNOWN) == (
        dynamic_policy.DYNAMIC_ADMIT,
        dynamic_policy.DYNAMIC_EVICT,
        dynamic_policy.DYNAMIC_UNKNOWN,
    )
    d = json.loads(json.dumps(SPEC))
    d["sparse"][0]["policy"] = {"halflife": True}
    with pytest.raises(
        ValueError, match=r"^spec: sparse\[0\] \(user\)\.policy\.halflife must be int"
    ):
        parse_spec(d)
    with pytest.raises(
        dynamic_policy.PolicyError, match="^dynamic table: halflife must be int"
    ) as e:
        Dynamic(halflife=True)
    assert e.value.key == "halflife"


def test_integers_pass_through_and_negative_ones_are_refused():
    ids, bad = raw_ids(pa.array([0, 5, 1 << 40, None, (1 << 63) - 3], pa.int64()))
    assert bad is None and ids.tolist() == [0, 5, 1 << 40, DYNAMIC_NULL, (1 << 63) - 3]
    assert raw_ids(pa.array([1, DYNAMIC_NULL], pa.int64()))[1] == 1  # the null id is no id
    assert raw_ids(pa.array([3, -1], pa.int32()))[1] == 1
    assert raw_ids(pa.array([1 << 63], pa.uint64()))[1] == 0
    floats, bad = raw_ids(pa.array([7.0, None, 2.5]))
    assert bad is None and floats.tolist()[:2] == [7, DYNAMIC_NULL]
    assert floats[2] == _reference_hash("2.5")


@pytest.fixture(scope="module")
def dynamic_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dynamic")
    preprocess_table(parse_spec(SPEC), [write_parquet(tmp / "t.parquet", _cols())], tmp / "pq")
    return tmp / "pq"


def test_a_dynamic_dataset_keeps_raw_int64_ids_and_its_manifest_round_trips(dynamic_dir, tmp_path):
    cols = _cols()
    preprocess_table(parse_spec(SPEC), [write_csv(tmp_path / "t.csv", cols)], tmp_path / "csv")
    a, b = open_dataset(dynamic_dir), open_dataset(tmp_path / "csv")
    assert a.categorical.dtype == np.int64
    ids = np.asarray(a.categorical)[: len(cols["user"])]
    # CSV reads every cell as text: an integer id there is the same id as in Parquet
    np.testing.assert_array_equal(ids, np.asarray(b.categorical)[: len(cols["user"])])
    want_user = [DYNAMIC_NULL if u is None else u for u in cols["user"]]
    assert ids[:, 0].tolist() == want_user
    assert ids[:, 1].tolist() == [_reference_hash(v) for v in cols["item"]]
    assert ids[1, 2:].tolist() == [(1 << 35) + 1, 1] and ids[0, 2:].tolist() == [-1, -1]

    m = Manifest.load(dynamic_dir)
    assert json.loads((dynamic_dir / "manifest.json").read_text()) == m.to_dict()
    user, item, _ = m.features
    assert user["encoding"] == "dynamic" and user["num_embeddings"] == 64
    # the policy as the spec gives it; the trainer fills the rest with Dynamic's defaults
    assert user["dynamic"] == {"min_count": 2, "admit": "count", "evict": "lru", "buckets": 8}
    assert user["distinct_train"] == 9 and item["dynamic"] == {"min_count": 1}
    counts = np.load(dynamic_dir / m.tables[0].counts_file)
    assert counts["ids"].tolist() == sorted({u for u in want_user[:18] if u != DYNAMIC_NULL})


def test_model_dynamic_comes_from_the_spec_and_config_keys_override_it(dynamic_dir):
    user = Manifest.load(dynamic_dir).features[0]
    base = ["data=table", f"data.path={dynamic_dir}", "train.batch_size=4"]
    cfg = validate(
        compose([*base, "+model.dynamic.user.evict=lfu", "+model.dynamic.item.buckets=4"])
    )
    model = cfg.model
    assert model.num_embeddings_per_feature == [64, 128, 64]
    assert set(model.dynamic) == {"user", "item", "tags"}
    # keys set in the config override the spec's, the rest stay
    assert model.dynamic["user"]["evict"] == "lfu" and model.dynamic["user"]["buckets"] == 8
    tables = {t.name: t for t in model.tables()}
    assert tables["user"].dynamic == Dynamic(**{**user["dynamic"], "evict": "lfu"})
    assert tables["item"].dynamic.buckets == 4 and tables["tags"].dynamic == Dynamic()
    assert validate(cfg).model == model  # idempotent, as a resumed run re-validates

    raw = compose(base)
    for policy, message in (
        ({"user": {"evcit": "lru"}}, r"model\.dynamic\.user\.evcit is not a policy key; keys: adm"),
        ({"user": {"evict": "fifo"}}, r"model\.dynamic\.user\.evict='fifo' is not one of"),
        ({"user": {"min_count": "2"}}, r"model\.dynamic\.user\.min_count must be int, got '2'"),
        ({"item": {"buckets": 5}}, r"model\.dynamic\.item: the table's 128 rows .* buckets=5"),
        ({"x": {"evict": "lru"}}, r"model\.dynamic\.x: 'x' is not a table in the dataset"),
    ):
        bad = OmegaConf.merge(raw, {"model": {"dynamic": policy}})
        with pytest.raises(ValueError, match="^" + message):
            validate(bad)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"policy": {"evcit": "lru"}}, "sparse[0] (user).policy.evcit is not a key of"),
        ({"policy": {"evict": "fifo"}}, "sparse[0] (user).policy.evict='fifo' is not one of"),
        ({"policy": {"evict": "ttl"}}, "sparse[0] (user).policy.ttl_steps is required with evict"),
        ({"policy": {"probability": 2}}, "sparse[0] (user).policy.probability must be in (0, 1]"),
        ({"policy": {"buckets": 0}}, "sparse[0] (user).policy.buckets must be >= 1, got 0"),
        ({"capacity": None}, "sparse[0] (user).capacity is required with encoding: dynamic"),
        ({"capacity": 60}, "sparse[0] (user).capacity=60 must be a multiple of policy.buckets=8"),
        ({"encoding": "hashing", "cap": 9}, "sparse[0] (user).capacity applies to encoding: dyn"),
        ({"policy": "lru"}, "sparse[0] (user).policy must be a mapping"),
    ],
)
def test_a_bad_dynamic_key_is_one_line_naming_it(change, message):
    d = json.loads(json.dumps(SPEC))
    d["sparse"][0].update(change)
    if change.get("encoding") == "hashing":
        del d["sparse"][0]["min_count"], d["sparse"][0]["policy"]
    d["sparse"][0] = {k: v for k, v in d["sparse"][0].items() if v is not None}
    with pytest.raises(ValueError) as e:
        parse_spec(d)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"spec: {message}"), e.value


def test_table_rows_other_than_the_capacity_is_a_spec_error_exit_2(tmp_path, capsys):
    """A dynamic table's rows are its capacity: another tables[].rows is a mistake in the spec,
    so hybridrec-preprocess exits 2 (a usage error) with one line naming the keys, before
    reading any row (it used to be found after the first pass, exit 1)."""
    d = json.loads(json.dumps(SPEC))
    d["tables"][1]["rows"] = 100
    spec = write_spec(tmp_path / "s.yaml", d)
    src = write_parquet(tmp_path / "t.parquet", _cols())
    argv = ["--spec", str(spec), "--input", str(src), "--output", str(tmp_path / "out")]
    assert preprocess_main(argv) == 2
    assert capsys.readouterr().err == (
        f"hybridrec-preprocess: error: {spec}: tables[1] (item).rows=100 differs from sparse[1] "
        "(item).capacity=128; a dynamic table has capacity rows: leave rows out\n"
    )
    d["tables"][1]["rows"] = 128  # equal: accepted
    assert parse_spec(d).table("item").rows == 128


def test_a_negative_integer_id_names_the_column_and_row(tmp_path):
    cols = _cols()
    cols["user"][20] = -4
    src = write_parquet(tmp_path / "t.parquet", cols)
    with pytest.raises(
        ValueError, match=r"column 'user' holds id -4 at .*row 21.*\[0, 2\^63 - 2\)"
    ):
        preprocess_table(parse_spec(SPEC), [src], tmp_path / "out")
