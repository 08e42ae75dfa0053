"""examples/sequential/run.sh as written, on a small `user item` file and a few steps: two
ranks with the item table sharded row-wise (the sasrec_games preset), a val and a test row in
metrics.jsonl, and the report's two lines; a missing DATA file is one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.sequence.files import write_user_item

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "examples" / "sequential" / "run.sh"


def _run(out: Path, data: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DATA": str(data), "VENV": str(Path(sys.executable).parents[1])}
    return subprocess.run(
        ["bash", str(RUN), str(out), *overrides],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_the_example_trains_on_two_ranks_and_reports_val_and_test(tmp_path):
    data = write_user_item(tmp_path / "seq.txt")
    small = ("train.steps=4", "train.batch_size=8", "train.log_every=2", "eval.every=2")
    proc = _run(tmp_path / "out", data, *small, "train.retrieval.negatives=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "out" / "run_np2" / "main.log").read_text()
    assert "row_wise" in log  # the preset's plan: the item table split over both ranks
    rows = [json.loads(line) for line in open(tmp_path / "out" / "run_np2" / "metrics.jsonl")]
    assert rows[-1]["split"] == "test" and rows[-1]["step"] == 4
    lines = proc.stdout.strip().splitlines()[-2:]
    assert lines[0].startswith("val  sampled HR@10") and lines[1].startswith("test sampled HR@10")
    assert "step 4" in lines[1]


def test_a_missing_data_file_is_one_line(tmp_path):
    proc = _run(tmp_path / "out", tmp_path / "nope.txt")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"examples/sequential/run.sh: no sequences file at {tmp_path / 'nope.txt'}; "
        "set DATA=<a user item file>"
    ]
