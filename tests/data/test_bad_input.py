"""Bad input fails loudly and precisely: malformed rows (file:line), corrupt or truncated
blocks (caught against the manifest), and a model whose tables do not fit the dataset."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from hybridrec.data import CorruptBlockError, MalformedRowError, open_dataset
from hybridrec.data.criteo import TsvReader, parse_ints
from hybridrec.data.preprocess import PreprocessOptions, preprocess
from hybridrec.data.preprocess.output import partial_dir
from hybridrec.data.source import BinarySource, check_model_matches
from tests.configs import make_config


def test_parse_ints_grammar():
    arr = pa.array(
        [b"12", b"", b"-5", b"007", b"x1", b"-", b"1-2", b"9" * 18, b"9" * 19], pa.binary()
    )
    values, empty, bad = parse_ints(arr, 10, signed=True)
    assert values[:4].tolist() == [12, 0, -5, 7] and values[7] == 10**18 - 1
    assert empty.tolist() == [False, True] + [False] * 7
    assert bad.tolist() == [False] * 4 + [True, True, True, False, True]
    hexes = pa.array([b"05db9164", b"", b"FF", b"0x1", b"f" * 16, b"f" * 17], pa.binary())
    values, empty, bad = parse_ints(hexes.slice(0), 16, signed=False)
    assert values[0] == 0x05DB9164 and values[2] == 255 and values[4] == 2**64 - 1
    assert bad.tolist() == [False, False, False, True, False, True]


LINES = {
    "fields": ("1\t2\t3", "expected 40 tab-separated fields, got 3"),
    "hex": (None, "field 20 (C6) 'zz12' is not 1-16 hex digits"),
    "dense": (None, "field 5 (I4) '3.5' is not an integer"),
    "label": (None, "field 1 (label) must be 0 or 1, got '2'"),
    "empty": ("", "field 1 (label) must be 0 or 1, got ''"),
}


def _corrupt_copy(sample_tsv, tmp_path, kind: str, line: int) -> tuple:
    lines = sample_tsv.read_text().splitlines()
    f = lines[line - 1].split("\t")
    replacement, message = LINES[kind]
    if kind == "hex":
        f[19] = "zz12"
    elif kind == "dense":
        f[4] = "3.5"
    elif kind == "label":
        f[0] = "2"
    lines[line - 1] = replacement if replacement is not None else "\t".join(f)
    path = tmp_path / f"bad_{kind}.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path, message


@pytest.mark.parametrize("kind", sorted(LINES))
def test_malformed_row_names_file_and_line(tmp_path, sample_tsv, kind):
    path, message = _corrupt_copy(sample_tsv, tmp_path, kind, 123)
    with pytest.raises(MalformedRowError) as e:
        list(TsvReader(path, chunk_bytes=1 << 16))
    assert str(e.value).startswith(f"{path}:123: ")
    assert message in str(e.value)
    with pytest.raises(MalformedRowError, match=f"{path.name}:123: "):
        preprocess([path], tmp_path / "out", PreprocessOptions(split="rows"), progress=False)


def test_line_numbers_after_dropped_lines_and_across_blocks(tmp_path, sample_tsv):
    """Skipped short rows shift later rows' line numbers; blocks of 64 KiB split the file."""
    lines = sample_tsv.read_text().splitlines() * 5  # 1000 lines, several parse blocks
    lines[9] = "0\t1"  # line 10: too few fields
    lines[499] = "1\t2\t3"  # line 500
    f = lines[899].split("\t")
    f[30] = "q" * 8
    lines[899] = "\t".join(f)  # line 900: bad hex
    path = tmp_path / "multi.tsv"
    path.write_text("\n".join(lines) + "\n")
    reader = TsvReader(path, chunk_bytes=1 << 16, on_error="skip")
    rows = sum(len(c) for c in reader)
    assert rows == 997 and reader.skipped == 3
    assert [e.split(": ")[0] for e in reader.examples] == [f"{path}:{n}" for n in (10, 500, 900)]
    assert "field 31 (C17) 'qqqqqqqq'" in reader.examples[2]


def test_skip_mode_counts_and_reports(tmp_path, sample_tsv):
    path, _ = _corrupt_copy(sample_tsv, tmp_path, "hex", 7)
    report = preprocess(
        [path], tmp_path / "out", PreprocessOptions(split="rows", on_error="skip"), progress=False
    )
    m = report.manifest
    assert m.skipped_rows == 1 and m.sources[0].skipped_rows == 1 and m.num_rows == 199
    assert report.skipped_examples[0].startswith(f"{path}:7: field 20 (C6)")


@pytest.fixture()
def dataset_copy(tmp_path, sample_dataset):
    return shutil.copytree(sample_dataset, tmp_path / "ds")


def test_truncated_block_caught_at_open(dataset_copy):
    path = dataset_copy / "dense.npy"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CorruptBlockError, match=r"dense.npy is truncated: .* block 24 \(rows 192"):
        open_dataset(dataset_copy)


def test_corrupt_block_caught_by_checksum(dataset_copy):
    ds = open_dataset(dataset_copy)
    header = ds._offsets["categorical"]  # noqa: SLF001
    row_bytes = 26 * 4
    with open(dataset_copy / "categorical.npy", "r+b") as f:
        f.seek(header + 83 * row_bytes + 5)  # row 83 -> block 10 (block_rows 8)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CorruptBlockError, match=r"categorical.npy: block 10 \(rows 80..87\)"):
        open_dataset(dataset_copy, verify="full")
    # verify=read: opens fine, fails when a batch touches the block (and only then)
    ds = open_dataset(dataset_copy, verify="read")
    source = BinarySource(ds, shuffle=False)
    source.batch(0, 40, "train")  # rows 0..39: fine
    with pytest.raises(CorruptBlockError, match="block 10"):
        source.batch(2, 40, "train")  # rows 80..119
    # verify=size cannot see it (the sizes are intact): that is what checksums are for
    open_dataset(dataset_copy, verify="size")


def test_wrong_header_and_missing_file(dataset_copy):
    np.save(dataset_copy / "labels.npy", np.zeros((25, 8), np.float32))
    with pytest.raises(CorruptBlockError, match=r"labels.npy: header says float32"):
        open_dataset(dataset_copy)
    (dataset_copy / "labels.npy").unlink()
    with pytest.raises(CorruptBlockError, match="labels.npy is missing"):
        open_dataset(dataset_copy)
    (dataset_copy / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json is not valid JSON"):
        open_dataset(dataset_copy)


def test_model_must_match_dataset(sample_dataset):
    m = open_dataset(sample_dataset).manifest
    check_model_matches(m, make_config("data=criteo_sample").model, "x")  # the shipped model fits
    with pytest.raises(
        ValueError, match=r"has 26 categorical tables but the model \(dlrm_tiny\) has 6"
    ):
        check_model_matches(m, make_config().model, "x")
    rows = list(m.cardinalities)
    rows[7] += 1
    model = make_config(
        "data=criteo_sample", f"model.num_embeddings_per_feature=[{','.join(map(str, rows))}]"
    ).model
    with pytest.raises(ValueError) as e:
        check_model_matches(m, model, "x")
    assert str(e.value).startswith(f"table cat_7 (C8): the dataset x has {rows[7] - 1} ids")
    assert f"model.num_embeddings_per_feature=[{','.join(map(str, m.cardinalities))}]" in str(
        e.value
    )
    multi = make_config("data=criteo_sample", "model.hotness=2").model
    with pytest.raises(ValueError, match="table cat_0: model.hotness is 2 .* data.multi_hot="):
        check_model_matches(m, multi, "x")
    check_model_matches(m, multi, "x", multi_hot="synthetic")  # expanded from one-hot: fits


def test_trainer_rejects_mismatch_before_training(sample_dataset):
    from hybridrec.distributed import init_distributed
    from hybridrec.train.trainer import Trainer

    cfg = make_config(
        "data=criteo", f"data.path={sample_dataset}", "model=dlrm_kaggle", "device=cpu"
    )
    with pytest.raises(ValueError, match=r"table cat_0 \(C1\): the dataset .* has 15 ids"):
        Trainer(cfg, init_distributed("cpu"))


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="data.loader='bcast' is not one of: per_rank, broadcast"):
        make_config("data.loader=bcast")
    with pytest.raises(ValueError, match="data.reader='nvdali' is not one of: memmap, dali"):
        make_config("data=criteo_sample", "data.reader=nvdali")
    with pytest.raises(ValueError, match="data.path must name a directory"):
        make_config("data=criteo")
    with pytest.raises(ValueError, match="data.preprocess.train_fraction must be in"):
        make_config("data=criteo_sample", "data.preprocess.train_fraction=0")
    with pytest.raises(ValueError, match="data.prefetch must be >= 0"):
        make_config("data.prefetch=-1")


def test_malformed_row_in_a_parallel_run_and_the_cli(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from hybridrec.data.fake import write_fake_day

    raw = tmp_path / "raw"
    raw.mkdir()
    write_fake_day(raw / "day_0", 3000, seed=0)
    write_fake_day(raw / "day_1", 3000, seed=1)
    lines = (raw / "day_1").read_text().splitlines()
    lines[2499] = "7" + lines[2499][1:]  # label 7 on line 2500
    (raw / "day_1").write_text("\n".join(lines) + "\n")
    opts = PreprocessOptions(chunk_bytes=1 << 16)
    with pytest.raises(MalformedRowError, match=r"day_1:2500: field 1 \(label\)"):
        preprocess([raw], tmp_path / "out", opts, workers=2, progress=False)
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridrec.data.preprocess_cli",
            "--input",
            str(raw),
            "--output",
            str(tmp_path / "cli"),
            "--workers",
            "2",
        ],
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"hybridrec-preprocess: error: {raw / 'day_1'}:2500: field 1 (label)" in out.stderr


def test_split_smaller_than_a_batch_fails_at_start(sample_dataset):
    from hybridrec.data import build_source

    cfg = make_config(
        "data=criteo", f"data.path={sample_dataset}", "model=criteo_sample", "train.batch_size=256"
    )
    with pytest.raises(
        ValueError, match="split 'train' has 160 rows, fewer than one global batch of 256"
    ):
        build_source(cfg)
    padded = make_config(
        "data=criteo",
        f"data.path={sample_dataset}",
        "model=criteo_sample",
        "train.batch_size=256",
        "data.last_batch=pad",
    )
    assert build_source(padded).batch(0, 256).size == 256


def test_empty_and_corrupt_gzip_files_name_the_file(tmp_path, sample_tsv):
    """pyarrow's own errors ("Empty CSV file", "Truncated compressed stream") said neither
    which file nor, for gzip, that it is the file that is broken; a corrupt gzip was an
    OSError that the CLI printed as a traceback."""
    import gzip

    empty = tmp_path / "day_0"
    empty.write_bytes(b"")
    with pytest.raises(MalformedRowError, match=f"{empty}: the file is empty"):
        list(TsvReader(empty))
    data = gzip.compress(sample_tsv.read_bytes())
    truncated = tmp_path / "day_1.gz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(MalformedRowError, match=f"{truncated}: cannot be read .*Truncated"):
        list(TsvReader(truncated, on_error="skip"))
    garbage = tmp_path / "day_2.gz"
    garbage.write_bytes(b"\x1f\x8b\x08garbage")
    with pytest.raises(MalformedRowError, match=f"{garbage}: cannot be read"):
        preprocess([garbage], tmp_path / "out", PreprocessOptions(split="rows"), progress=False)


@pytest.mark.parametrize("encoding", ["hash", "vocab"])
def test_input_too_small_for_a_train_split(tmp_path, sample_tsv, encoding):
    """One row with split=rows gives 0 train rows: that used to be an IndexError from inside
    the id counter's merge (numpy), not a dataset. It builds (val/test rows only), and
    training on it says the train split is too small."""
    one = tmp_path / "one.tsv"
    one.write_text(sample_tsv.read_text().splitlines()[0] + "\n")
    out = tmp_path / "out"
    m = preprocess(
        [one], out, PreprocessOptions(split="rows", encoding=encoding), progress=False
    ).manifest
    assert m.num_rows == 1 and m.splits["train"] == [0, 0]
    with pytest.raises(ValueError, match="split 'train' has 0 rows"):
        BinarySource(open_dataset(out)).steps_per_epoch(1)


def test_criteo_sample_path_that_does_not_exist_is_an_error(tmp_path, monkeypatch):
    """data.path (or $HYBRIDREC_CRITEO_SAMPLE) naming a missing file used to fall back to the
    shared sample without a word: training on other data than asked for."""
    from hybridrec.data.source import SAMPLE_ENV, sample_path

    missing = tmp_path / "my_sample.tsv"
    with pytest.raises(ValueError, match=f"data.path={missing}: no such file"):
        sample_path(str(missing))
    monkeypatch.setenv(SAMPLE_ENV, str(missing))
    with pytest.raises(ValueError, match=f"\\${SAMPLE_ENV}={missing}: no such file"):
        sample_path(None)


@pytest.mark.parametrize("split", [[0, 500], [100, 90], [-8, 160]])
def test_manifest_split_outside_the_rows_is_named(dataset_copy, split):
    """A split past the dataset's rows used to pass the open and fail at the first batch
    with an IndexError from numpy; a reversed one silently evaluated nothing."""
    import json

    path = dataset_copy / "manifest.json"
    m = json.loads(path.read_text())
    m["splits"]["train"] = split
    path.write_text(json.dumps(m))
    with pytest.raises(
        ValueError,
        match=rf"manifest.json: split 'train' \[{split[0]}, {split[1]}\) is not within the dataset's 200 rows",
    ):
        open_dataset(dataset_copy)


def _cli(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hybridrec.data.preprocess_cli", *argv, "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_binary_and_corrupt_inputs_are_one_line(tmp_path, sample_tsv):
    """A binary file is said to be neither gzip nor text (it was a leaked UnicodeDecodeError
    from pyarrow's row handler and a gzip hint); a corrupt gzip is one line naming it; a gzip
    of binary says so. Nothing is left behind: no output directory, no .work/."""
    import gzip

    npy = tmp_path / "day_0.npy"
    np.save(npy, np.arange(1000.0))
    noise = tmp_path / "day_1"
    noise.write_bytes(np.random.default_rng(0).bytes(5000))
    data = gzip.compress(sample_tsv.read_bytes())
    corrupt = tmp_path / "day_2.gz"
    corrupt.write_bytes(data[:100] + b"x" * 60 + data[160:])
    zipped_binary = tmp_path / "day_3.gz"
    zipped_binary.write_bytes(gzip.compress(npy.read_bytes()))
    cases = {
        npy: f"{npy}: is not a gzip file nor text (it starts with b'\\x93NUMPY",
        noise: f"{noise}: is not a gzip file nor text (it starts with b'",
        corrupt: f"{corrupt}: cannot be read after 0 row(s): ",
        zipped_binary: f"{zipped_binary}: is a gzip file whose content is not text",
    }
    for k, (path, message) in enumerate(cases.items()):
        out = tmp_path / f"out{k}"
        r = _cli("--input", str(path), "--output", str(out), "--split", "rows")
        assert r.returncode == 1, r.stderr
        assert r.stderr.startswith(f"hybridrec-preprocess: error: {message}")
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
        assert "UnicodeDecodeError" not in r.stderr
        assert ("gzip file?" in r.stderr) == (path is corrupt)
        assert not out.exists()


def test_unwritable_output_is_one_line(tmp_path, sample_tsv):
    (tmp_path / "file").write_text("")
    r = _cli("--input", str(sample_tsv), "--output", str(tmp_path / "file" / "out"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.endswith(
        f"hybridrec-preprocess: error: --output {tmp_path / 'file' / 'out'} cannot be a "
        f"directory ({tmp_path / 'file'} is a file)\n"
    )
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    r = _cli("--input", str(sample_tsv), "--output", str(locked / "out"))
    if os.geteuid() != 0:  # root writes anywhere
        assert r.returncode == 1 and r.stderr.endswith(
            f"hybridrec-preprocess: error: PermissionError: [Errno 13] cannot create "
            f"{locked / '.out.partial'}, where the dataset for --output {locked / 'out'} is "
            "built before it is swapped in: Permission denied\n"
        )


@pytest.mark.parametrize("encoding", ["hash", "vocab"])
def test_failed_preprocess_leaves_no_work_dir(tmp_path, sample_tsv, encoding):
    """A worker failing on a bad row of the second file, after the first file's part is
    written: the run raises and removes its partial directory (and .work/ in it); the output
    directory it did not create stays as it was."""
    path, message = _corrupt_copy(sample_tsv, tmp_path, "hex", 150)
    good = tmp_path / "day_0.tsv"
    shutil.copy(sample_tsv, good)
    bad = path.rename(tmp_path / "day_1.tsv")
    out = tmp_path / "out"
    out.mkdir()
    opts = PreprocessOptions(split="rows", encoding=encoding)
    with pytest.raises(MalformedRowError, match=f"{bad}:150: "):
        preprocess([good, bad], out, opts, workers=1, progress=False)
    assert out.is_dir() and list(out.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day_0.tsv", "day_1.tsv", "out"]
    # with keep_work the parts stay, for a look (and the good file's part is there)
    with pytest.raises(MalformedRowError):
        preprocess([good, bad], out, opts, workers=1, progress=False, keep_work=True)
    stage = "count" if encoding == "vocab" else "parts"
    work = partial_dir(out) / ".work"
    assert work == tmp_path / ".out.partial" / ".work"
    assert (work / stage / "0000_day_0.tsv" / "meta.json").is_file()
    assert list(out.iterdir()) == []


def _criteo_cfg(path):
    overrides = [
        "data=criteo",
        f"data.path={path}",
        "data.verify=size",  # the poisoned block's checksum no longer matches
        "model=criteo_sample",
        "train.batch_size=24",
        "eval.batch_size=6",
        "train.steps=3",
        "eval.every=0",
        "device=cpu",
    ]
    return make_config(*overrides)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_nonfinite_dense_feature_names_the_dataset_row(tmp_path, sample_dataset, split):
    """A NaN or inf dense value in a dataset (written by something else than
    hybridrec-preprocess, or damaged without checksums) is bad input: the error names the
    feature, its name in the manifest, the sample and the dataset row (train or eval)."""
    from hybridrec.distributed import init_distributed
    from hybridrec.train.dense_check import NonFiniteInputError
    from hybridrec.train.trainer import Trainer

    ds = shutil.copytree(sample_dataset, tmp_path / "ds")
    t = Trainer(_criteo_cfg(ds), init_distributed("cpu"))
    if split == "train":  # sample 5 of the second step
        lo, hi = t.source.plan(24, "train").segments(1, 5, 6)[0]
    else:  # the first val row
        lo = t.source.dataset.split("val")[0]
    dense = np.load(ds / "dense.npy", mmap_mode="r+")
    block_rows = dense.shape[1]
    dense[lo // block_rows, lo % block_rows, 3] = np.inf
    dense.flush()
    del dense
    t = Trainer(_criteo_cfg(ds), init_distributed("cpu"))
    with pytest.raises(NonFiniteInputError) as e:
        t.fit()
    where = "sample 5 of training step 2" if split == "train" else "sample 0 of eval batch 0"
    assert str(e.value).startswith(
        f"dense feature 3 (I4) is inf at {where} (row {lo} of dataset {ds}): bad input data"
    )
    assert "\n" not in str(e.value)
