"""`hybridrec-preprocess --overwrite` never loses the previous dataset: the new one is built
beside the output and swapped in only when complete. Every way a run can fail or stop is
tried against a finished dataset (with a file of the user's in its directory), as a user runs
the CLI: a bad number, a bad spec, a missing column, no train rows, Ctrl-C, a full disk,
kill -9, and for the Criteo parser a malformed row, a full disk and Ctrl-C. Each leaves the
directory byte for byte as it was, and nothing beside it (except what a resume needs)."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hybridrec.data.preprocess as criteo_preprocess
from hybridrec.data import open_dataset
from hybridrec.data.preprocess_cli import main as preprocess_main
from hybridrec.data.tabular.write import SplitParts
from tests.data.tables import SPEC, movies, spec_dict, write_csv, write_spec

REPO = Path(__file__).resolve().parents[2]


def _snapshot(d: Path) -> dict[str, str]:
    """Every file under `d` (hidden ones too) -> its sha256."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def built(tmp_path):
    """A finished table dataset in tmp_path/ds (plus the user's README), its spec and args."""
    spec = write_spec(tmp_path / "s.yaml", SPEC)
    good = write_csv(tmp_path / "good.csv", movies())
    args = ["--spec", str(spec), "--output", str(tmp_path / "ds")]
    assert preprocess_main([*args, "--input", str(good)]) == 0
    (tmp_path / "ds" / "README").write_text("my notes on this dataset\n")
    return tmp_path, args, _snapshot(tmp_path / "ds")


def _unchanged(tmp_path: Path, before: dict[str, str], partial_left: bool = False) -> None:
    assert _snapshot(tmp_path / "ds") == before
    assert (tmp_path / ".ds.partial").exists() == partial_left
    open_dataset(tmp_path / "ds")  # still a complete dataset


def _fails(capsys, args: list[str], code: int) -> str:
    assert preprocess_main(args) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.removeprefix("hybridrec-preprocess: error: ").strip()


def test_a_successful_overwrite_replaces_the_dataset_and_keeps_the_users_files(built):
    tmp_path, args, before = built
    cols = movies()
    cols["rating"] = [5] * len(cols["rating"])
    other = write_csv(tmp_path / "other.csv", cols)
    assert preprocess_main([*args, "--input", str(other), "--overwrite"]) == 0
    assert open_dataset(tmp_path / "ds").labels.min() == 1.0
    assert (tmp_path / "ds" / "README").read_text() == "my notes on this dataset\n"
    assert _snapshot(tmp_path / "ds") != before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_data_errors_keep_the_previous_dataset(built, capsys):
    tmp_path, args, before = built
    cols = movies()
    cols["age"] = [str(a) if a is not None else None for a in cols["age"]]
    cols["age"][7] = "abc"
    bad = write_csv(tmp_path / "bad_number.csv", cols)
    err = _fails(capsys, [*args, "--input", str(bad), "--overwrite"], 1)
    assert err == f"dense column 'age' holds 'abc' at {bad} row 8, not a number"
    _unchanged(tmp_path, before)
    no_train = write_spec(
        tmp_path / "no_train.yaml",
        spec_dict(split={"by": "column", "column": "movie", "values": {"train": ["99"]}}),
    )
    args2 = ["--spec", str(no_train), "--output", str(tmp_path / "ds")]
    err = _fails(capsys, [*args2, "--input", str(tmp_path / "good.csv"), "--overwrite"], 1)
    assert err.startswith("no rows in the train split")
    _unchanged(tmp_path, before)


def test_spec_and_column_errors_exit_2_and_keep_the_previous_dataset(built, capsys):
    tmp_path, args, before = built
    good = str(tmp_path / "good.csv")
    bad_spec = tmp_path / "bad.yaml"
    bad_spec.write_text("label: {column: rating, task: sometimes}\n")
    err = _fails(capsys, ["--spec", str(bad_spec), "--input", good, "--output",
                          str(tmp_path / "ds"), "--overwrite"], 2)  # fmt: skip
    assert err.startswith(f"{bad_spec}: label.task='sometimes' is not one of")
    _unchanged(tmp_path, before)
    d = spec_dict()
    d["sparse"][0]["column"] = "usr"
    missing = write_spec(tmp_path / "missing.yaml", d)
    err = _fails(capsys, ["--spec", str(missing), "--input", good, "--output",
                          str(tmp_path / "ds"), "--overwrite"], 2)  # fmt: skip
    assert err.startswith(f"{good}: column 'usr' (spec sparse[0] (user).column) is not in")
    _unchanged(tmp_path, before)


def test_ctrl_c_and_a_full_disk_keep_the_previous_dataset(built, capsys, monkeypatch):
    tmp_path, args, before = built
    cols = movies()
    cols["rating"] = [5] * len(cols["rating"])
    other = [*args, "--input", str(write_csv(tmp_path / "other.csv", cols)), "--overwrite"]

    def interrupt(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(SplitParts, "assemble", interrupt)
    assert _fails(capsys, other, 130) == f"interrupted; {tmp_path / 'ds'} was not changed"
    _unchanged(tmp_path, before)

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SplitParts, "add", full)
    err = _fails(capsys, other, 1)
    assert err.startswith(f"no space left on the device of {tmp_path} (") and err.endswith(
        f" free) while writing the new dataset in {tmp_path / '.ds.partial'}; free space "
        f"there, or give an --output on another disk; {tmp_path / 'ds'} was not changed"
    )
    _unchanged(tmp_path, before)


def test_kill_9_while_writing_keeps_the_previous_dataset(built):
    """SIGKILL in the middle of writing the arrays (no cleanup can run): the output is as it
    was; the partial directory left beside it is cleared by the next run, which succeeds."""
    tmp_path, args, before = built
    cols = movies()
    cols["rating"] = [5] * len(cols["rating"])
    other = [*args, "--input", str(write_csv(tmp_path / "other.csv", cols)), "--overwrite"]
    script = (
        "import os, signal, sys\n"
        "from hybridrec.data.tabular.write import SplitParts\n"
        "from hybridrec.data.preprocess_cli import main\n"
        "def killed(self, *a, **k):\n"
        "    (self.work.parent / 'labels.npy').write_bytes(b'half')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "SplitParts.assemble = killed\n"
        "main(sys.argv[1:])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", script, *other], env=env, timeout=120)
    assert r.returncode == -9
    _unchanged(tmp_path, before, partial_left=True)
    assert preprocess_main(other) == 0
    assert open_dataset(tmp_path / "ds").labels.min() == 1.0
    assert not (tmp_path / ".ds.partial").exists()


def test_criteo_failures_keep_the_previous_dataset(tmp_path, sample_tsv, capsys, monkeypatch):
    """The raw Criteo parser: a malformed row, a full disk, Ctrl-C (which keeps the partial
    directory's .work/ so the same command resumes)."""
    out = tmp_path / "ds"
    base = ["--output", str(out), "--split", "rows", "--no-progress"]
    assert preprocess_main(["--input", str(sample_tsv), *base]) == 0
    (out / "README").write_text("mine\n")
    before = _snapshot(out)
    lines = sample_tsv.read_text().splitlines(keepends=True)
    bad = tmp_path / "bad.tsv"
    bad.write_text("".join(lines[:99]) + "1\tnot a number\n" + "".join(lines[99:]))
    err = _fails(capsys, ["--input", str(bad), *base, "--overwrite"], 1)
    assert err.startswith(f"{bad}:100: ")
    _unchanged(tmp_path, before)
    shutil.copy(sample_tsv, tmp_path / "day.tsv")
    other = ["--input", str(tmp_path / "day.tsv"), *base, "--encoding", "vocab", "--overwrite"]

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(criteo_preprocess, "_assemble_array", full)
    assert _fails(capsys, other, 1).startswith(f"no space left on the device of {tmp_path} (")
    _unchanged(tmp_path, before)

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(criteo_preprocess, "_assemble_array", interrupt)
    err = _fails(capsys, other, 130)
    assert err == f"interrupted; {out} was not changed (the same command resumes)"
    _unchanged(tmp_path, before, partial_left=True)
    monkeypatch.undo()
    assert preprocess_main(other) == 0
    assert "1 file(s) reused" in capsys.readouterr().out
    assert (out / "README").read_text() == "mine\n" and not (tmp_path / ".ds.partial").exists()


def test_the_two_rename_swap_where_no_atomic_exchange_exists(built, monkeypatch):
    """Without renameat2 (not Linux, or a filesystem without it) the swap is two renames:
    the same result, and a failed second rename puts the previous dataset back."""
    from hybridrec.data.preprocess import output as output_module

    tmp_path, args, before = built
    monkeypatch.setattr(output_module, "_exchange", lambda a, b: False)
    cols = movies()
    cols["rating"] = [5] * len(cols["rating"])
    other = [*args, "--input", str(write_csv(tmp_path / "other.csv", cols)), "--overwrite"]
    real_rename = os.rename

    def failing(src, dst):
        if Path(src).name == ".ds.partial" and Path(dst).name == "ds":
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_rename(src, dst)

    monkeypatch.setattr(output_module.os, "rename", failing)
    assert preprocess_main(other) == 1
    _unchanged(tmp_path, before)
    monkeypatch.setattr(output_module.os, "rename", real_rename)
    assert preprocess_main(other) == 0
    assert open_dataset(tmp_path / "ds").labels.min() == 1.0
    assert (tmp_path / "ds" / "README").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
