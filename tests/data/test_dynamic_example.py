"""examples/dynamic: the drifting stream is deterministic, its ids are raw 40-bit values that
appear and fade, report.py turns the runs' metrics into result.json, and EXACT=1 run.sh on a
small stream gives the 1-rank run's losses on 2 ranks, bit for bit."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]
STREAM = runpy.run_path(str(ROOT / "examples" / "dynamic" / "make_stream.py"))
REPORT = runpy.run_path(str(ROOT / "examples" / "dynamic" / "report.py"))
SMALL = ["--days", "4", "--rows-per-day", "3000", "--users", "2000", "--items", "300"]


def _day(out: Path, d: int):
    return pq.read_table(out / "stream" / f"day={d}" / "part-0.parquet")


def test_the_stream_is_deterministic_and_its_ids_drift(tmp_path):
    STREAM["main"]([str(tmp_path / "a"), *SMALL])
    STREAM["main"]([str(tmp_path / "b"), *SMALL])
    info = json.loads((tmp_path / "a" / "stream.json").read_text())
    other = json.loads((tmp_path / "b" / "stream.json").read_text())
    assert info["days"] == other["days"]
    users = []
    for d in range(4):
        a, b = _day(tmp_path / "a", d), _day(tmp_path / "b", d)
        assert a.equals(b)  # the same arguments write the same rows
        assert a.column_names == ["clicked", "x0", "x1", "user", "item"] and a.num_rows == 3000
        u = a["user"].to_numpy()
        assert u.min() >= 0 and u.max() < 1 << 40 and u.max() > 1 << 32  # raw 40-bit ids
        users.append(set(u.tolist()))
    new_last = users[3] - set().union(*users[:3])
    gone = users[0] - users[3]
    assert info["days"][3]["new_users"] == len(new_last) > 0 and gone  # ids appear and fade
    assert 0.5 < info["bayes_auc_last_day"] < 1.0


def _run(path: Path, losses: dict[int, float], auc: float, exact: bool = False) -> None:
    (path / ".hydra").mkdir(parents=True)  # the composed config hybridrec.main writes
    (path / ".hydra" / "config.yaml").write_text(f"train: {{exact: {exact}, exact_shards: 4}}\n")
    rows = [{"step": s, "split": "train", "loss": v} for s, v in losses.items()]
    rows.append({"step": max(losses), "split": "eval", "auc": auc})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_writes_the_aucs_and_the_largest_relative_loss_gap(tmp_path):
    (tmp_path / "stream.json").write_text(json.dumps({"bayes_auc_last_day": 0.9}))
    _run(tmp_path / "run_dynamic", {2: 0.5, 4: 0.4}, 0.70)
    _run(tmp_path / "run_dynamic_np2", {2: 0.5, 4: 0.4 * (1 + 2e-6)}, 0.70)
    _run(tmp_path / "run_hashing", {2: 0.5, 4: 0.45}, 0.66)
    _run(tmp_path / "run_unbounded", {2: 0.5, 4: 0.41}, 0.703)
    result = REPORT["main"](tmp_path)
    assert json.loads((tmp_path / "result.json").read_text()) == result
    assert result["auc_dynamic"] == 0.70 and result["auc_hashing"] == 0.66
    assert result["auc_unbounded"] == 0.703 and result["max_rel_loss_diff_step"] == 4
    assert result["max_rel_loss_diff_1_vs_2_ranks"] == pytest.approx(2e-6, rel=1e-6)
    assert result["goals"] == {
        "dynamic_beats_hashing": True,
        "dynamic_within_0.005_of_unbounded": True,
        "rel_loss_diff_le_1e-5": True,
    }
    (tmp_path / "run_dynamic_np2" / "metrics.jsonl").unlink()
    with pytest.raises(SystemExit, match="run_dynamic_np2/metrics.jsonl is missing"):
        REPORT["main"](tmp_path)


def test_report_says_the_mode_and_refuses_runs_of_two_modes(tmp_path):
    (tmp_path / "stream.json").write_text(json.dumps({"bayes_auc_last_day": 0.9}))
    for name in ("dynamic", "dynamic_np2"):
        _run(tmp_path / f"run_{name}", {2: 0.5, 4: 0.4}, 0.70, exact=True)
    _run(tmp_path / "run_hashing", {2: 0.5, 4: 0.45}, 0.66)
    _run(tmp_path / "run_unbounded", {2: 0.5, 4: 0.41}, 0.703)
    result = REPORT["main"](tmp_path)
    assert result["mode"] == "exact" and result["exact_shards"] == 4
    assert result["max_rel_loss_diff_1_vs_2_ranks"] == 0 and result["goals"]["rel_loss_diff_is_0"]
    (tmp_path / "run_dynamic_np2" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "split": "train", "loss": 0.4}) + "\n" for s in (2, 4))
    )
    assert REPORT["main"](tmp_path)["goals"]["rel_loss_diff_is_0"] is False  # 0.5 != 0.4
    config = tmp_path / "run_dynamic_np2" / ".hydra" / "config.yaml"
    config.write_text("train: {exact: false, exact_shards: 4}\n")  # the 2-rank run: default
    with pytest.raises(SystemExit, match="trained in different modes"):
        REPORT["main"](tmp_path)


@pytest.mark.slow
def test_exact_run_sh_gives_the_one_rank_losses_on_two_ranks(tmp_path):
    """EXACT=1 examples/dynamic/run.sh as written on an 8-day stream of 1024 rows a day (14
    steps of 512): every logged loss of the 2-rank dynamic run equals the 1-rank run's."""
    env = {
        **os.environ,
        "EXACT": "1",
        "STREAM_ARGS": "--rows-per-day 1024 --users 1500 --items 200",
        "VENV": str(Path(sys.executable).parents[1]),
    }
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(ROOT / "examples" / "dynamic" / "run.sh"), str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["mode"] == "exact" and result["exact_shards"] == 8
    assert result["steps_compared"] == 7  # steps 2, 4, .., 14
    assert result["max_rel_loss_diff_1_vs_2_ranks"] == 0.0
    assert result["goals"]["rel_loss_diff_is_0"] is True
