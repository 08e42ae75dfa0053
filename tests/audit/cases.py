"""The open-world audit's row type and its one outcome rule, shared by its sections."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    """One audit case: `check(workdir)` runs it and returns None when it behaved as
    `expected` says, else what it saw instead."""

    name: str
    check: Callable[[Path], str | None]
    expected: str


def _outcome(proc, code: int, starts: str, contains: str = "") -> str | None:  # noqa: ANN001
    """None when the run exited `code` with stderr's last line starting with `starts` (and
    holding `contains`), one line, no traceback; else what it did."""
    lines = proc.stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    if proc.returncode == code and last.startswith(starts) and contains in last:
        if "Traceback" not in proc.stderr:
            return None
    return f"exit {proc.returncode}; last stderr line: {last[:400]!r}"
