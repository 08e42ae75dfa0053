"""Checkpoint-and-stop on the signals schedulers send before they kill a job.

SLURM (`--signal=USR1@120`, or SIGTERM at preemption and time limits), Kubernetes and
torchrun's agent send SIGTERM or SIGUSR1 some time before SIGKILL. With `checkpoint.dir` set,
the trainer turns them into a request: at the next logging step (where it synchronises anyway)
the ranks agree whether any of them got one, and if so they save a checkpoint (atomically,
as always) and stop; running the same command again resumes from it. Without a checkpoint
directory the signals keep their default effect.

Ctrl-C (SIGINT) is a request too; a second Ctrl-C more than `SECOND_INTERRUPT_S` later
aborts at once (the first one may reach a rank twice: from the terminal and from a launcher
passing it on). A run stopped this way exits with PREEMPTED_EXIT (75, EX_TEMPFAIL: "try
again"), not 0: a Kubernetes Job or a SLURM requeue reads 0 as finished and would not restart it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PREEMPTED_EXIT = 75  # the exit code of a run that saved and stopped on a signal
SECOND_INTERRUPT_S = 2.0

log = logging.getLogger("hybridrec")


class PreemptionGuard:
    """While entered (and enabled, on the main thread), SIGTERM, SIGUSR1 and SIGINT only
    record their name in `received`; the previous handlers come back on exit."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._interrupted_at: float | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._interrupted_at is not None and now - self._interrupted_at > SECOND_INTERRUPT_S:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving
            self._interrupted_at = self._interrupted_at or now
        self.received = self.received or signal.Signals(signum).name

    def agreed(self, any_rank: Callable[[bool], bool], step: int) -> bool:
        """Whether any rank received a stop signal; `any_rank(flag)` asks them all (a
        collective: every rank calls this at the same step, a logging step). A yes is logged:
        the run saves a checkpoint at `step` and stops."""
        if not any_rank(self.received is not None):
            return False
        log.warning(
            "%s received: saving a checkpoint at step %d and stopping; run the same command "
            "again to resume",
            self.received or "a stop signal (on another rank)",
            step,
        )
        return True

    def __enter__(self) -> PreemptionGuard:
        if self.enabled:
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()


def fault_injection(rank: int) -> int | None:
    """Test hook: HYBRIDREC_FAULT=<rank>:<step> kills that rank at that step, on the first
    attempt of a torchrun job only (TORCHELASTIC_RESTART_COUNT=0), to prove crash-resume."""
    spec = os.environ.get("HYBRIDREC_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    fault_rank, fault_step = (int(x) for x in spec.split(":"))
    return fault_step if fault_rank == rank else None
