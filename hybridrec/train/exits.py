"""How a run ends for the shell: exit codes and one-line errors.

Exit codes: USAGE_EXIT (2) when the command or its config is wrong and nothing ran,
FAILED_EXIT (1) for an error while running, PREEMPTED_EXIT (75, hybridrec.train.preemption)
for a run that saved a checkpoint and stopped on a signal, 0 for a finished run.

The project's own errors (RUN_ERRORS: bad values, files, checkpoints, ids, memory, non-finite
losses, collectives) print as `hybridrec-train: <message>`, without a traceback
(`HYDRA_FULL_ERROR=1` shows it). A rank started by a launcher (torchrun or
`launcher.nproc_per_node`) also writes its message to `TORCHELASTIC_ERROR_FILE` in torch
elastic's format, with a nanosecond time, so the launcher can name the rank that failed
first and why (`first_failure`, `failure_line`), not only the exit codes: a rank that died
without a word (kill -9, the OOM killer, a crash) is the cause of its peers' failed
collectives, and the line names it before the rank that noticed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from hybridrec.distributed import CollectiveError
from hybridrec.sparse.host import CacheTooSmallError, HostMemoryError
from hybridrec.train.checkpoint import CheckpointError
from hybridrec.train.health import NonFiniteLossError
from hybridrec.train.preemption import PREEMPTED_EXIT

USAGE_EXIT, FAILED_EXIT = 2, 1
__all__ = [
    "FAILED_EXIT",
    "PREEMPTED_EXIT",
    "RUN_ERRORS",
    "USAGE_EXIT",
    "fail",
    "failure_line",
    "first_failure",
]

RUN_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,  # config, data, ids, dense inputs, plans
    OSError,  # files and directories
    CheckpointError,
    HostMemoryError,
    CacheTooSmallError,
    NonFiniteLossError,
    CollectiveError,
)


def show_traceback() -> bool:
    """The user asked for full tracebacks (Hydra's own switch)."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def fail(message: str, code: int) -> NoReturn:
    """Print `hybridrec-train: <message>`, leave it for a launcher, exit with `code`."""
    print(f"hybridrec-train: {message}", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {
            "message": {
                "message": message,
                "extraInfo": {"timestamp": str(int(time.time())), "time_ns": time.time_ns()},
            }
        }
        try:
            Path(error_file).write_text(json.dumps(record))
        except OSError:
            pass  # the message is on stderr already
    raise SystemExit(code)


def _recorded(failure: Any) -> tuple[str | None, int]:
    """(message, time in ns) that `fail` left for one rank's failure (None, 0 if none)."""
    try:
        data = json.loads(Path(failure.error_file).read_text())["message"]
        return str(data["message"]), int(data["extraInfo"].get("time_ns", 0))
    except (OSError, ValueError, KeyError, TypeError):
        return None, 0


# A message that reports another rank's failure, not its own: a collective a peer left
# (hybridrec.distributed.failure.CollectiveError) or a check another rank failed.
_ECHOES = ("collective '", "another rank")
# what a launcher sends the ranks still running once one has failed (torch elastic: SIGTERM)
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _kind(message: str | None, exitcode: int) -> int:
    """0: failed with its own error; 1: died without a word (killed by a signal, crashed);
    2: stopped by the launcher (SIGTERM and no message), or reported a failure it noticed
    on another rank, or saved and stopped (PREEMPTED_EXIT) when told to."""
    if exitcode == PREEMPTED_EXIT:
        return 2
    if message is not None:
        return 2 if any(e in message for e in _ECHOES) else 0
    return 2 if exitcode in [-int(s) for s in _STOP_SIGNALS] else 1


def first_failure(failures: dict[int, Any]) -> tuple[int, str | None, int]:
    """(rank, message or None, exit code) of the rank whose failure caused the others, from
    torch elastic's ProcessFailure records: a rank's own error first (by time), then a rank
    that died without a message (SIGKILL, a crash: the peers' collectives fail because it
    went away), then the ranks that noticed a failure or were stopped by the launcher. The
    record times cannot order the second kind: torch elastic stamps those when it collects
    them, after the peers wrote theirs."""
    recorded = {rank: _recorded(f) for rank, f in failures.items()}

    def order(rank: int) -> tuple[int, int, int]:
        message, when = recorded[rank]
        return _kind(message, int(failures[rank].exitcode)), when, rank

    rank = min(failures, key=order)
    return rank, recorded[rank][0], int(failures[rank].exitcode)


def died(exitcode: int) -> str:
    """How a rank that left no message ended: "was killed by signal 9 (SIGKILL, ...)"."""
    if exitcode >= 0:
        return f"exited with code {exitcode} without a message (see its output)"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "an unknown signal"
    if -exitcode == signal.SIGKILL:
        name += ", which the kernel's out-of-memory killer sends too: see dmesg"
    return f"was killed by signal {-exitcode} ({name}) without a message"


def failure_line(failures: dict[int, Any], n: int, logs: Path) -> tuple[str, int]:
    """The last line of a multi-rank run whose ranks failed, and the exit code to end with:
    the rank that caused it (`first_failure`) and what happened to it, then, when it died
    without a word, what the first rank to notice reported."""
    rank, message, code = first_failure(failures)
    failed = f"{len(failures)} of {n} ranks failed; their output is above and in {logs}"
    exit_code = code if code in (USAGE_EXIT, FAILED_EXIT) else FAILED_EXIT
    if message is not None:
        return f"rank {rank} failed first: {message} ({failed})", exit_code
    line = f"rank {rank} {died(code)}"
    others = {r: _recorded(f) for r, f in failures.items() if r != rank}
    noticed = sorted((when, r) for r, (said, when) in others.items() if said is not None)
    if noticed:
        first = noticed[0][1]
        line += f"; then rank {first} failed: {others[first][0]}"
    return f"{line} ({failed})", exit_code
