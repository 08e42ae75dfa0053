"""Criteo as one dataset spec (examples/criteo/spec.yaml): on the real sample, the spec path
(`hybridrec-preprocess --spec`) writes the same dataset as the fast Criteo parser with the
same split and min_count, and trains identically.

The two paths agree by construction, not by a mapping: both read an empty field as null
(id 0, dense 0), apply log(1 + max(x, 0)) in float64 and store float32, and number a
vocabulary 2.. by decreasing train count with ties by value. The fast parser orders tied
values by their hex number, the spec path by their text; for Criteo's 8-digit lowercase hex
strings the two orders are the same, so the ids are equal bit for bit. What differs by
design: labels are float32 (0.0/1.0) instead of uint8. The spec names its tables as the
fast parser does (cat_0..cat_25), so the manifests' tables and counts files are the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hybridrec.data.dataset import open_dataset
from hybridrec.data.manifest import Manifest
from hybridrec.data.spec import load_spec
from hybridrec.data.tabular import preprocess_table
from tests.cli import REPO, run_cli
from tests.data.conftest import SAMPLE_OPTIONS, vocab_ids

SPEC = REPO / "examples" / "criteo" / "spec.yaml"


# the module's tests share one module-scoped fixture: one test worker runs them all, so it
# is built once (scripts/test.sh: pytest-xdist --dist loadgroup)
pytestmark = pytest.mark.xdist_group("data/test_criteo_spec")


@pytest.fixture(scope="module")
def spec_dataset(tmp_path_factory, sample_tsv: Path) -> Path:
    out = tmp_path_factory.mktemp("criteo_spec") / "bin"
    preprocess_table(load_spec(SPEC), [sample_tsv], out, block_rows=SAMPLE_OPTIONS["block_rows"])
    return out


def test_the_spec_asks_for_what_the_fast_path_is_compared_with():
    spec = load_spec(SPEC)
    assert spec.input.header is False and spec.input.format == "tsv"
    assert spec.input.columns[:2] == ("label", "I1") and len(spec.input.columns) == 40
    assert [d.transform for d in spec.dense] == ["log1p"] * 13
    assert {(s.encoding, s.min_count) for s in spec.sparse} == {
        ("vocabulary", SAMPLE_OPTIONS["min_count"])
    }
    assert [s.column for s in spec.sparse] == [f"C{i}" for i in range(1, 27)]
    assert [s.table for s in spec.sparse] == [f"cat_{t}" for t in range(26)]
    assert (spec.split.by, spec.split.train_fraction) == (
        SAMPLE_OPTIONS["split"],
        SAMPLE_OPTIONS["train_fraction"],
    )


def test_spec_path_equals_the_fast_parser_on_the_real_sample(
    spec_dataset, sample_dataset, sample_parsed
):
    a, b = open_dataset(spec_dataset), open_dataset(sample_dataset)
    labels = np.asarray(a.labels)
    assert labels.dtype == np.float32 and set(np.unique(labels)) <= {0.0, 1.0}
    assert np.array_equal(labels.astype(np.uint8), np.asarray(b.labels))
    for name in ("dense", "categorical"):
        x, y = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name  # bitwise, padding rows included
    # and both are what plain Python makes of the file (ids 0 null, 1 rare, 2.. by count)
    n = len(sample_parsed.labels)
    flat = np.asarray(a.categorical).reshape(-1, 26)[:n]
    assert flat.tolist() == vocab_ids(sample_parsed, 160, SAMPLE_OPTIONS["min_count"])

    ma, mb = Manifest.load(spec_dataset), Manifest.load(sample_dataset)
    assert ma.splits == mb.splits == {"train": [0, 160], "val": [160, 180], "test": [180, 200]}
    assert ma.tables == mb.tables  # names, cardinalities, counts files, hottest ids
    for t in ma.tables:
        with (
            np.load(spec_dataset / t.counts_file) as x,
            np.load(sample_dataset / t.counts_file) as y,
        ):
            assert np.array_equal(x["ids"], y["ids"]), t.name
            assert np.array_equal(x["counts"], y["counts"]), t.name


def test_cli_trains_the_spec_dataset_as_it_trains_the_fast_one(
    spec_dataset, sample_dataset, tmp_path
):
    """data=table on the spec-made directory (its model filled from the manifest) and
    data=criteo on the fast parser's, with model=criteo_sample: the same losses and eval."""
    common = (
        "train.steps=3",
        "train.batch_size=16",
        "train.log_every=1",
        "eval.batch_size=10",
        "eval.batches=null",
        "optim.dense.name=sgd",
        "device=cpu",
    )
    runs = {}
    for name, data in (
        ("spec", ("data=table", f"data.path={spec_dataset}", f"data.spec={SPEC}")),
        ("fast", ("data=criteo", f"data.path={sample_dataset}", "model=criteo_sample")),
    ):
        run = tmp_path / name
        out = run_cli(*data, *common, f"hydra.run.dir={run}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    spec, fast = runs["spec"], runs["fast"]
    assert [r["step"] for r in spec if "loss" in r] == [1, 2, 3]
    for key in ("loss", "auc", "logloss"):
        a = [r[key] for r in spec if key in r]
        assert a and a == [r[key] for r in fast if key in r], key
