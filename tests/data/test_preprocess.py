"""Preprocessing real Criteo rows: every stored value equals a plain-Python parse of the TSV.

The 200 real rows of shared/data/criteo_sample.tsv go through hybridrec-preprocess (vocab and
hash encodings); each label, each log-transformed dense value and each categorical id is
compared with what a line-by-line `str.split` / `int(x, 16)` parse and the documented rules
give. Then: the manifest's round trip, idempotent and resumed reruns, the day split over
several (gzip) files run in parallel, and the CLI.
"""

from __future__ import annotations

import gzip
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import hybridrec.data.preprocess as preprocess_package
from hybridrec.data import open_dataset
from hybridrec.data.fake import write_fake_day
from hybridrec.data.manifest import Manifest
from hybridrec.data.preprocess import PreprocessOptions, preprocess
from hybridrec.data.preprocess.output import partial_dir
from tests.data.conftest import SAMPLE_OPTIONS, log1p32, vocab_ids

REPO = Path(__file__).resolve().parents[2]


def _expect_common(ds, parsed) -> None:
    assert ds.num_rows == 200 and len(parsed.labels) == 200
    np.testing.assert_array_equal(ds.labels, np.array(parsed.labels, np.uint8))
    want = np.array([[log1p32(x) for x in row] for row in parsed.dense], np.float32)
    np.testing.assert_array_equal(ds.dense, want)  # bit-exact: float64 log1p, then float32


def test_sample_vocab_every_value(sample_dataset, sample_parsed):
    ds = open_dataset(sample_dataset, verify="full")
    m = ds.manifest
    assert m.splits == {"train": [0, 160], "val": [160, 180], "test": [180, 200]}
    _expect_common(ds, sample_parsed)
    ids = np.array(vocab_ids(sample_parsed, 160, 2), np.int32)
    np.testing.assert_array_equal(ds.categorical, ids)
    assert m.cardinalities == [int(ids[:160, t].max()) + 1 for t in range(26)]
    # train id frequencies, for hot-row caches: exactly the counts of the train ids
    for t in (0, 5, 25):
        with np.load(sample_dataset / m.tables[t].counts_file) as z:
            got = dict(zip(z["ids"].tolist(), z["counts"].tolist(), strict=True))
        assert got == dict(Counter(ids[:160, t].tolist()))
        assert m.tables[t].top_ids[0] == list(Counter(ids[:160, t].tolist()).most_common(1)[0])
    assert m.encoding["kind"] == "vocab" and m.encoding["min_count"] == 2
    assert "applied at write" in m.transforms["dense"]
    assert m.sources[0].rows == 200 and m.sources[0].train_rows == 160


def test_sample_hash_every_value(tmp_path, sample_tsv, sample_parsed):
    caps = [1000 + 7 * t for t in range(26)]
    preprocess(
        [sample_tsv],
        tmp_path,
        PreprocessOptions(encoding="hash", hash_cap=tuple(caps), split="rows", block_rows=16),
        progress=False,
    )
    ds = open_dataset(tmp_path)
    _expect_common(ds, sample_parsed)
    want = [[(v or 0) % caps[t] for t, v in enumerate(row)] for row in sample_parsed.cat]
    np.testing.assert_array_equal(ds.categorical, np.array(want, np.int32))
    assert ds.manifest.cardinalities == caps
    with np.load(tmp_path / "counts" / "cat_3.npz") as z:
        got = dict(zip(z["ids"].tolist(), z["counts"].tolist(), strict=True))
    assert got == dict(Counter(r[3] for r in want[:160]))


def test_manifest_round_trip(sample_dataset, tmp_path):
    m = Manifest.load(sample_dataset)
    raw = json.loads((sample_dataset / "manifest.json").read_text())
    assert m.to_dict() == raw
    m.save(tmp_path)
    assert Manifest.load(tmp_path) == m
    assert json.loads((tmp_path / "manifest.json").read_text()) == raw
    assert m.num_blocks == 25 and len(m.arrays["dense"].block_crc32) == 25
    assert m.schema["categorical"]["fields"][0] == "C1" and m.tables[0].field == "C1"
    raw["version"] = 99
    with pytest.raises(ValueError, match="format version 99"):
        Manifest.from_dict(raw)


def test_rerun_is_idempotent_and_other_options_need_overwrite(tmp_path, sample_tsv):
    opts = PreprocessOptions(**SAMPLE_OPTIONS)
    first = preprocess([sample_tsv], tmp_path, opts, progress=False)
    before = (tmp_path / "categorical.npy").stat().st_mtime_ns
    again = preprocess([sample_tsv], tmp_path, opts, progress=False)
    assert again.up_to_date and again.manifest == first.manifest
    assert (tmp_path / "categorical.npy").stat().st_mtime_ns == before
    other = PreprocessOptions(**{**SAMPLE_OPTIONS, "min_count": 1})
    with pytest.raises(ValueError, match="pass --overwrite"):
        preprocess([sample_tsv], tmp_path, other, progress=False)
    third = preprocess([sample_tsv], tmp_path, other, progress=False, overwrite=True)
    assert sum(third.manifest.cardinalities) > sum(first.manifest.cardinalities)


def _days(tmp_path: Path, n: int, rows: int, gz: bool = False) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    for d in range(n):
        write_fake_day(raw / (f"day_{d}" + (".gz" if gz else "")), rows, seed=d)
    return raw


def test_day_split_parallel_gzip_and_resume(tmp_path, monkeypatch):
    raw = _days(tmp_path, 3, 3000, gz=True)
    # 64 KiB chunks: every file is parsed in several blocks
    opts = PreprocessOptions(encoding="vocab", min_count=3, block_rows=512, chunk_bytes=1 << 16)
    out = tmp_path / "bin"
    full = preprocess([raw], out, opts, workers=2, progress=False, keep_work=True)
    m = full.manifest
    assert [s.file for s in m.sources] == ["day_0.gz", "day_1.gz", "day_2.gz"]
    assert m.splits == {"train": [0, 6000], "val": [6000, 7500], "test": [7500, 9000]}
    assert [s.train_rows for s in m.sources] == [3000, 3000, 0]
    # the same rows read from plain text files give the same dataset (gzip is transparent)
    plain = tmp_path / "plain"
    plain.mkdir()
    for d in range(3):
        with gzip.open(raw / f"day_{d}.gz", "rb") as src, open(plain / f"day_{d}", "wb") as dst:
            shutil.copyfileobj(src, dst)
    ref = preprocess([plain], tmp_path / "bin_plain", opts, workers=1, progress=False)
    a, b = open_dataset(out), open_dataset(tmp_path / "bin_plain")
    np.testing.assert_array_equal(a.categorical, b.categorical)
    np.testing.assert_array_equal(a.dense, b.dense)
    assert ref.manifest.cardinalities == m.cardinalities
    assert (out / ".work" / "parts").is_dir()  # keep_work: the parts moved in with the data
    # resume: a run interrupted (Ctrl-C) while assembling keeps its parts beside the output,
    # which it never touched; pretend it was interrupted before day_1 was committed
    shutil.rmtree(out)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(preprocess_package, "_assemble_array", interrupt)
    with pytest.raises(KeyboardInterrupt):
        preprocess([raw], out, opts, workers=2, progress=False)
    monkeypatch.undo()
    assert not out.exists()
    (partial_dir(out) / ".work" / "parts" / "0001_day_1.gz" / "meta.json").unlink()
    resumed = preprocess([raw], out, opts, workers=2, progress=False)
    assert resumed.reused_files == 2 and resumed.manifest.splits == m.splits
    np.testing.assert_array_equal(open_dataset(out).categorical, b.categorical)
    assert not (out / ".work").exists() and not partial_dir(out).exists()


def test_day_split_needs_enough_files(tmp_path, sample_tsv):
    with pytest.raises(ValueError, match="use split=rows"):
        preprocess([sample_tsv], tmp_path, PreprocessOptions(split="days"), progress=False)


def test_cli(tmp_path):
    raw = _days(tmp_path, 2, 500)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "hybridrec.data.preprocess_cli", "--input", str(raw)]
    cmd += ["--output", str(tmp_path / "bin"), "--hash-cap", "5000", "--block-rows", "128"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "1,000 rows (train 500, val 250, test 250)" in out.stdout
    assert open_dataset(tmp_path / "bin").manifest.cardinalities == [5000] * 26
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "up to date" in again.stdout
    assert (again.stdout + again.stderr).count("up to date") == 1
    assert "cardinalities: 5,000 x26" in out.stdout
    bad = subprocess.run(
        cmd[:-4] + ["--hash-cap", "0"], env=env, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "hash_cap" in bad.stderr and "Traceback" not in bad.stderr


def test_row_split_across_parse_blocks(tmp_path):
    raw = _days(tmp_path, 1, 3001)
    opts = PreprocessOptions(split="rows", hash_cap=50, chunk_bytes=1 << 16, block_rows=100)
    m = preprocess([raw], tmp_path / "bin", opts, progress=False).manifest
    assert m.splits == {"train": [0, 2400], "val": [2400, 2700], "test": [2700, 3001]}
    ds = open_dataset(tmp_path / "bin")
    with np.load(tmp_path / "bin" / "counts" / "cat_0.npz") as z:
        assert z["counts"].sum() == 2400  # id counts cover the train rows only
        assert z["counts"].tolist() == np.bincount(ds.categorical[:2400, 0])[z["ids"]].tolist()


def _readme_preprocess_commands() -> list[list[str]]:
    """The Criteo `hybridrec-preprocess` commands of the README's bash blocks and docs/data.md's
    1TB hashing one, as argv lists (a `--spec` command preprocesses a table:
    tests/data/test_table_train.py runs it)."""
    readme = (REPO / "README.md").read_text()
    hashing = (REPO / "docs" / "data.md").read_text()
    hashing = hashing[hashing.index("hybridrec-preprocess --input /data/criteo/raw") :]
    text = (readme + "\n" + hashing.split("```")[0]).replace("\\\n", " ")
    return [
        shlex.split(line)[1:]
        for line in text.splitlines()
        if line.strip().startswith("hybridrec-preprocess ") and "--spec" not in line
    ]


def test_readme_preprocess_examples_run_on_the_shipped_sample(tmp_path, sample_tsv):
    """The README's commands (and the 1TB one it points to), with the shipped sample as the input (the raw directory then
    holds that one file): one input file defaults to a row split, with a note, instead of
    failing on a day split that has no day to hold out."""
    commands = _readme_preprocess_commands()
    assert len(commands) == 2 and all("--input" in c and "--output" in c for c in commands)
    raw = tmp_path / "raw"
    raw.mkdir()
    shutil.copy(sample_tsv, raw / "day_0")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for k, argv in enumerate(commands):
        argv = list(argv)
        src = argv[argv.index("--input") + 1]
        assert src in ("../shared/data/criteo_sample.tsv", "/data/criteo/raw")
        argv[argv.index("--input") + 1] = str(sample_tsv if src.endswith(".tsv") else raw)
        argv[argv.index("--output") + 1] = str(tmp_path / f"bin{k}")
        cmd = [sys.executable, "-m", "hybridrec.data.preprocess_cli", *argv, "--no-progress"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "one input file: splitting its rows (the first 0.8 train" in out.stderr
        assert "200 rows (train 160, val 20, test 20)" in out.stdout
        assert open_dataset(tmp_path / f"bin{k}").manifest.options["split"] == "rows"
    # an explicit day split of one file is still the clear error it was
    bad = subprocess.run(
        cmd + ["--split", "days", "--output", str(tmp_path / "days")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr  # the options: usage
    assert bad.stderr.count("\n") == 1 and "use split=rows" in bad.stderr
    assert not (tmp_path / "days").exists() and not (tmp_path / ".days.partial").exists()


def test_cardinalities_are_summarised_as_runs():
    from hybridrec.data.preprocess_cli import summarise_counts

    assert summarise_counts([40_000_000] * 26) == "40,000,000 x26"
    assert summarise_counts([3, 3, 7, 40, 40, 40, 3]) == "3 x2, 7, 40 x3, 3"
