"""A torch.profiler window over a few training steps (train.profile_steps > 0).

The trainer opens the window after step `train.profile_start` (past compilation and cache
warm-up) and closes it `train.profile_steps` steps later. While it is open, every phase the
trainer times (input_dist, lookup, output_dist, backward, sparse_update, dense_optimizer, ...)
is also a named region in the trace. Written to `<run dir>/profile/`:

    trace_rank<r>.json   Chrome trace: open in https://ui.perfetto.dev or chrome://tracing
    ops_rank<r>.txt      the ops that took the most time, torch.profiler's table

and a log line with the host synchronisations the CUDA runtime recorded inside the steps
(`cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize`, synchronous
`cudaMemcpy`; logging between steps is left out): a step with device-resident tables should
have none (host-memory tables sync by design: a lookup must know how many rows to fetch).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hybridrec.timing import PhaseTimer

log = logging.getLogger("hybridrec")

STEP = "train_step"  # the region the trainer marks around each step
SYNC_CALLS = (
    "cudaDeviceSynchronize",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",  # the synchronous copy; cudaMemcpyAsync is not a sync
)


def host_syncs(events: list) -> dict[str, int]:  # noqa: ANN001
    """How often each host-synchronising CUDA runtime call occurs inside a `train_step` region
    on the same thread (logging and evaluation between steps sync on purpose).

    `events`: torch.profiler FunctionEvents (name, thread, time_range.start/.end)."""
    steps = [(e.thread, e.time_range.start, e.time_range.end) for e in events if e.name == STEP]

    def in_a_step(e) -> bool:  # noqa: ANN001
        r = e.time_range
        return any(t == e.thread and a <= r.start and r.end <= b for t, a, b in steps)

    found = Counter(e.name for e in events if e.name in SYNC_CALLS and in_a_step(e))
    return dict(sorted(found.items()))


class StepProfiler:
    """Profiles steps (start, start + steps] of a run; `after_step(step)` drives it."""

    def __init__(
        self,
        out_dir: Path,
        rank: int,
        start: int,
        steps: int,
        device: torch.device,
        timer: PhaseTimer,
    ) -> None:
        self.out_dir, self.rank = out_dir, rank
        self.start, self.stop = start, start + steps
        self.device, self.timer = device, timer
        self._prof: profile | None = None
        self.syncs: dict[str, int] | None = None  # set once the window has closed

    def after_step(self, step: int) -> None:
        """Call after optimizer step `step`: opens or closes the window at its bounds."""
        if step == self.start and self._prof is None and self.syncs is None:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities)
            self._prof.__enter__()
            self.timer.annotate = True
        elif self._prof is not None:
            self._prof.step()
            if step >= self.stop:
                self._close(step)

    def close(self) -> None:
        """End a window still open (a run shorter than start + steps)."""
        if self._prof is not None:
            self._close(None)

    def _close(self, step: int | None) -> None:
        assert self._prof is not None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prof.__exit__(None, None, None)
        self.timer.annotate = False
        prof, self._prof = self._prof, None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
        (self.out_dir / f"ops_rank{self.rank}.txt").write_text(table + "\n")
        self.syncs = host_syncs(list(prof.events()))
        window = f"steps {self.start + 1}..{step if step is not None else 'end'}"
        found = ", ".join(f"{n} x{c}" for n, c in self.syncs.items()) or "none"
        log.info("profile of %s written to %s; host syncs in it: %s", window, trace, found)
