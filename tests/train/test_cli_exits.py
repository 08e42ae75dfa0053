"""What `hybridrec-train` prints and returns when a run cannot start, fails, or is stopped:
one `hybridrec-train: <message>` line and no traceback, exit 2 for the config, 1 for a
failure, 75 for a run that saved and stopped on a signal; with several ranks the launcher's
last line names the rank that failed first and its message."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.cli import REPO, run_cli


def _last(out: subprocess.CompletedProcess) -> str:
    return out.stderr.strip().splitlines()[-1]


def test_config_and_runtime_errors_are_one_line_with_their_exit_codes(tmp_path):
    bad = run_cli("train.steps=-3", cwd=tmp_path)
    assert (
        bad.returncode == 2 and bad.stderr == "hybridrec-train: train.steps must be > 0, got -3\n"
    )
    typed = run_cli("train.steps=abc", cwd=tmp_path)
    assert typed.returncode == 2
    assert typed.stderr == "hybridrec-train: train.steps must be an integer, got 'abc'\n"
    missing = run_cli("checkpoint.resume=/nonexistent", f"hydra.run.dir={tmp_path}/r", cwd=tmp_path)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert _last(missing) == (
        "hybridrec-train: checkpoint.resume='/nonexistent': no such checkpoint directory"
    )
    full = run_cli("train.steps=-3", cwd=tmp_path, HYDRA_FULL_ERROR="1")
    assert full.returncode != 0 and "Traceback" in full.stderr  # the trace, when asked for


@pytest.mark.slow
def test_launcher_names_the_first_failing_rank_and_its_message(tmp_path):
    out = run_cli(
        "launcher.nproc_per_node=2",
        "sharding=table_wise",
        "device=cpu",
        "checkpoint.resume=/nonexistent",
        f"hydra.run.dir={tmp_path}/r",
        cwd=tmp_path,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    last = _last(out)
    assert last.startswith("hybridrec-train: rank ") and " failed first: checkpoint.resume=" in last
    assert "no such checkpoint directory (2 of 2 ranks failed; their output is above" in last


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_exits_75(tmp_path):
    """A scheduler's SIGTERM to the process that started the ranks reaches them; they save
    and the job exits 75 (not 0, which a Kubernetes Job or SLURM reads as finished)."""
    args = [
        "launcher.nproc_per_node=2",
        "sharding=table_wise",
        "device=cpu",
        f"checkpoint.dir={tmp_path}/ck",
        "train.steps=1000000",
        "train.log_every=5",
        f"hydra.run.dir={tmp_path}/r",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridrec.main", *args],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until training is under way
            line = proc.stderr.readline()
            lines.append(line)
            if " loss " in line:
                break
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert proc.returncode == 75, "".join(lines) + rest
    assert "Traceback" not in rest
    assert rest.strip().splitlines()[-1] == (
        "hybridrec-train: SIGTERM received: the ranks saved a checkpoint at their next logging "
        "step and stopped; run the same command again to resume"
    )
    assert list((tmp_path / "ck").glob("step_*/manifest.json"))
