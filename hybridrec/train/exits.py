"""How a run ends for the shell: exit codes and one-line errors.

Exit codes: USAGE_EXIT (2) when the command or its config is wrong and nothing ran,
FAILED_EXIT (1) for an error while running, PREEMPTED_EXIT (75, hybridrec.train.preemption)
for a run that saved a checkpoint and stopped on a signal, 0 for a finished run.

The project's own errors (RUN_ERRORS: bad values, files, checkpoints, ids, memory, non-finite
losses, collectives) print as `hybridrec-train: <message>`, without a traceback
(`HYDRA_FULL_ERROR=1` shows it). A rank started by a launcher (torchrun or
`launcher.nproc_per_node`) also writes its message to `TORCHELASTIC_ERROR_FILE` in torch
elastic's format, with a nanosecond time, so the launcher can name the rank that failed
first and why (`first_failure`), not only the exit codes.
"""

from __future__ import annotations

import json
import os
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
__all__ = ["FAILED_EXIT", "PREEMPTED_EXIT", "RUN_ERRORS", "USAGE_EXIT", "fail", "first_failure"]

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


def first_failure(failures: dict[int, Any]) -> tuple[int, str | None, int]:
    """(rank, message or None, exit code) of the rank that failed first, from torch elastic's
    ProcessFailure records: ranks with a message before those without, a rank reporting its
    own error before one reporting another rank's ("another rank ..."), then by time."""

    recorded = {rank: _recorded(f) for rank, f in failures.items()}

    def order(rank: int) -> tuple[bool, bool, int, int]:
        message, when = recorded[rank]
        echo = message is not None and "another rank" in message
        return message is None, echo, when, rank

    rank = min(failures, key=order)
    return rank, recorded[rank][0], int(failures[rank].exitcode)
