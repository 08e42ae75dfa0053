"""Per-phase step timings that do not synchronise the GPU inside the step.

On CUDA each phase records a pair of events on the current stream; they are resolved only
when `report()` is called (at logging time, which synchronises anyway). On CPU it is plain
wall-clock time. A disabled timer costs one attribute check per phase.

Library code times itself with the module-level `phase(name)`, which feeds whichever timer
the caller made active (`with timing.active(timer):`, the trainer's); none active: no cost.
The active timer is process-wide, not per thread, because autograd runs CUDA backwards (and
the host cache its prefetch) on other threads.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Accumulates time per named phase between reports."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = True) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.enabled = enabled
        self.annotate = False  # also a named region in a torch.profiler trace (while profiling)
        self._cpu: dict[str, float] = defaultdict(float)
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        with self.region(name):
            yield from self._timed(name)

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """A named region in a profiler trace while profiling; not timed."""
        if self.annotate:
            with torch.profiler.record_function(name):
                yield
        else:
            yield

    def _timed(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[name].append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._cpu[name] += time.perf_counter() - t0

    def report(self, steps: int) -> dict[str, float]:
        """Milliseconds per step for each phase since the last report; resets."""
        out = {name: 1e3 * s / max(steps, 1) for name, s in self._cpu.items()}
        if self._events:
            torch.cuda.synchronize()
            for name, pairs in self._events.items():
                out[name] = sum(a.elapsed_time(b) for a, b in pairs) / max(steps, 1)
        self._cpu.clear()
        self._events.clear()
        return out


NULL_TIMER = PhaseTimer(enabled=False)


_active: PhaseTimer = NULL_TIMER


@contextmanager
def active(timer: PhaseTimer) -> Iterator[PhaseTimer]:
    """Make `timer` the one `phase()` feeds until the block ends."""
    global _active
    previous, _active = _active, timer
    try:
        yield timer
    finally:
        _active = previous


def phase(name: str):  # noqa: ANN201 (a context manager)
    """Time a named phase on the active timer (see `active`)."""
    return _active.phase(name)
