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
import torch

from hybridrec.train.exits import fail, failure_line, first_failure
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


def test_a_nan_setting_is_a_config_error_as_a_negative_one_is(tmp_path):
    """optim.sparse.weight_decay=nan passed the >= 0 check (NaN compares false) and failed in
    the run, exit 1; -1 exits 2. Both are the config's error now (issue 41)."""
    for value, shown in (("nan", "nan"), ("-1", None)):
        out = run_cli(f"optim.sparse.weight_decay={value}", cwd=tmp_path)
        why = "must be a finite number, got nan" if shown else "must be >= 0, got -1.0"
        assert out.returncode == 2, out.stderr
        assert out.stderr == f"hybridrec-train: optim.sparse.weight_decay {why}\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_a_config_error(tmp_path):
    """It exited 1 (found when the process group started), docs/training.md says 2: a
    config error, found before anything runs, one process or several."""
    for extra in ((), ("launcher.nproc_per_node=2", "sharding=table_wise")):
        out = run_cli("device=cuda", *extra, f"hydra.run.dir={tmp_path}/r", cwd=tmp_path)
        assert out.returncode == 2 and out.stderr == (
            "hybridrec-train: device=cuda but CUDA is not available here; use device=cpu or auto\n"
        )


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


class _Failure:
    """What torch elastic records for a failed rank (ProcessFailure): its exit code and the
    error file `fail` writes (absent for a rank that died without a word)."""

    def __init__(self, exitcode: int, error_file: str) -> None:
        self.exitcode, self.error_file = exitcode, error_file


def _failed(tmp_path, rank: int, exitcode: int, message: str | None = None) -> _Failure:
    path = tmp_path / f"error_{rank}.json"
    path.parent.mkdir(exist_ok=True)
    if message is not None:  # as the rank itself leaves it
        os.environ["TORCHELASTIC_ERROR_FILE"] = str(path)
        try:
            with pytest.raises(SystemExit):
                fail(message, exitcode)
        finally:
            del os.environ["TORCHELASTIC_ERROR_FILE"]
    return _Failure(exitcode, str(path))


NOTICED = (
    "collective 'dense_grads (DDP all-reduce)' at training step 12 failed on rank 1: a peer "
    "closed its connection (it exited or crashed); no word from rank 0 (dead, or still "
    "waiting on the dead one)"
)


def test_the_rank_that_died_without_a_word_is_named_before_the_one_that_noticed(tmp_path, capsys):
    """The audit's case: rank 0 SIGKILLed, rank 1's all-reduce fails and rank 1 writes its
    message before the launcher stops it; the line blamed rank 1 ("failed first")."""
    logs = tmp_path / "ranks"
    failures = {0: _failed(tmp_path, 0, -9), 1: _failed(tmp_path, 1, 1, NOTICED)}
    capsys.readouterr()
    assert failure_line(failures, 2, logs) == (
        "rank 0 was killed by signal 9 (SIGKILL, which the kernel's out-of-memory killer sends "
        f"too: see dmesg) without a message; then rank 1 failed: {NOTICED} (2 of 2 ranks "
        f"failed; their output is above and in {logs})",
        1,
    )
    # rank 1 SIGKILLed, rank 0 stopped by the launcher (SIGTERM): it was rank 0 "first"
    failures = {0: _failed(tmp_path / "a", 0, -15), 1: _failed(tmp_path / "a", 1, -9)}
    line, code = failure_line(failures, 2, logs)
    assert line.startswith("rank 1 was killed by signal 9 (SIGKILL") and code == 1
    # a crash without a message (a segfault) is a cause too, and an exit without one
    failures = {0: _failed(tmp_path, 0, 1, NOTICED), 1: _failed(tmp_path / "b", 1, -11)}
    assert failure_line(failures, 2, logs)[0].startswith(
        "rank 1 was killed by signal 11 (SIGSEGV) without a message; then rank 0 failed: "
    )
    failures = {0: _failed(tmp_path / "c", 0, -15), 1: _failed(tmp_path / "c", 1, 3)}
    assert failure_line(failures, 2, logs)[0].startswith(
        "rank 1 exited with code 3 without a message (see its output) (2 of 2"
    )


def test_a_ranks_own_error_comes_before_the_ranks_that_noticed_it(tmp_path, capsys):
    own = "checkpoint.resume='/nonexistent': no such checkpoint directory"
    echo = "rank 0: another rank found an out-of-range id in this batch"
    failures = {
        0: _failed(tmp_path, 0, 1, echo),
        1: _failed(tmp_path, 1, -15),
        2: _failed(tmp_path, 2, 1, own),
        3: _failed(tmp_path, 3, 1, NOTICED),
    }
    capsys.readouterr()
    assert first_failure(failures) == (2, own, 1)
    assert failure_line(failures, 4, tmp_path)[0].startswith(f"rank 2 failed first: {own} (4")
    later = {0: _failed(tmp_path / "d", 0, 2, "written later"), 1: failures[2]}  # by time
    assert first_failure(later)[0] == 1


def _kill_rank_after_the_first_loss(tmp_path, rank: int) -> tuple[int, str]:
    """A 2-rank run started the user's way; SIGKILL one rank's process once it trains."""
    run_dir = tmp_path / f"kill{rank}"
    args = [
        "launcher.nproc_per_node=2",
        "sharding=table_wise",
        "device=cpu",
        "train.steps=1000000",
        "train.log_every=5",
        "eval.every=0",
        f"hydra.run.dir={run_dir}",
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
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and " loss " not in proc.stderr.readline():
            pass
        victims = [
            pid
            for pid in os.listdir("/proc")
            if pid.isdigit() and _is_rank(int(pid), rank, str(run_dir))
        ]
        assert len(victims) == 1, victims
        os.kill(int(victims[0]), signal.SIGKILL)
        rest = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    return proc.returncode, rest


def _is_rank(pid: int, rank: int, run_dir: str) -> bool:
    try:
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode()
    except OSError:
        return False
    return f"RANK={rank}".encode() in environ and run_dir in cmdline


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank in /proc")
@pytest.mark.parametrize("rank", [0, 1])
def test_kill_9_of_a_rank_names_that_rank(tmp_path, rank):
    code, err = _kill_rank_after_the_first_loss(tmp_path, rank)
    assert code == 1 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        f"hybridrec-train: rank {rank} was killed by signal 9 (SIGKILL, which the kernel's "
        "out-of-memory killer sends too: see dmesg) without a message"
    ), last
    assert last.endswith(
        f"(2 of 2 ranks failed; their output is above and in {tmp_path}/kill{rank}/ranks)"
    )
