"""Small helpers shared by the benchmarks: where it ran, how long it took, how to print it.

- `hardware()`: one line naming the CPU, core count, GPU (or none), torch, Python and date,
  written next to every result.
- `time_steps(step, steps, warmup, before=None)`: per-step wall times in seconds after
  `warmup` untimed calls; `before()` runs untimed before each step (a barrier, a sync).
- `median(xs)`, `markdown_table(headers, rows)`, `command_line()`, `host_cores()`,
  `load_average()`, `git_state()`, `cpu_seconds()`.
- `sync(device)`, `reset_device(device)` (between runs), `peak_memory(device, unit)`.
- `compose_config(overrides, world_size=1)`: the validated config hybridrec-train would run.
Run every benchmark from the repository root as a module: `python -m benchmarks.<name>`.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch

from hybridrec.config import Config, compose
from hybridrec.configure import validate


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def host_cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def load_average() -> str:
    """'0.52 0.40 0.31': the 1, 5 and 15 minute load averages ('n/a' where unknown)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_seconds() -> tuple[float, float]:
    """(CPU-seconds all processes on the host have used since boot, CPU-seconds used by this
    process and its waited-for children). Differences taken over a run show how much CPU other
    processes took meanwhile; (nan, own) where /proc/stat is missing."""
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan"), own
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]  # user nice system irq softirq
    return busy / os.sysconf("SC_CLK_TCK"), own


def hardware() -> str:
    cores = host_cores()
    if torch.cuda.is_available():
        gpu = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    else:
        gpu = "no GPU"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"{cpu_model()}, {cores} cores usable, {gpu}; torch {torch.__version__}, "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}; {now}"
    )


def git_state() -> str:
    """'abc1234' or 'abc1234 + uncommitted changes' (read-only git queries)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + (" + uncommitted changes" if dirty else "")


def command_line() -> str:
    """How this process was started, ready to paste (from the repository root)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    start = ["-m", spec.name] if spec is not None else sys.argv[:1]
    return "python " + " ".join(shlex.quote(a) for a in [*start, *sys.argv[1:]])


def compose_config(overrides: Sequence[str], world_size: int = 1) -> Config:
    """conf/train.yaml with `overrides`, validated for `world_size` ranks (as hybridrec-train)."""
    return validate(compose(list(overrides)), world_size=world_size)


def time_steps(
    step: Callable[[int], object],
    steps: int,
    warmup: int,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Call step(0..warmup+steps-1); return the wall times of the last `steps` calls."""
    times = []
    for i in range(warmup + steps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        step(i)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def sync(device: torch.device) -> None:
    """Wait for the device (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_device(device: torch.device) -> None:
    """Between runs: the previous run's model must be gone before the next allocates (the
    1TB host tables need ~90 GiB per run), so drop compile caches that could still reference
    it, collect, free cached device memory and restart the peak-memory count."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device, unit: float) -> str:
    """Peak device memory allocated since the last reset, in `unit` bytes ('-' on the CPU)."""
    if device.type != "cuda":
        return "-"
    return f"{torch.cuda.max_memory_allocated(device) / unit:.1f}"
