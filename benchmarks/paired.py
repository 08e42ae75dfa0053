"""Paired, interleaved comparisons of training systems on a shared machine, and their parity.

Systems that train the same model on the same batches run one after another within each step
(step_order alternates who goes first); each step's pair of times then met the same load, so
the ratio of the pair divides out load that comes and goes, and the median of those ratios
(paired_ratio, and median_ci for its interval) is a fair speed ratio where medians of each
side taken apart are not. A comparison of speed means something only if both train the same
model: their losses must agree to float32 round-off over the first steps (loss_gaps,
parity_failures). Systems timed in one process share its heap: hold_heap keeps either from
paying the other's page faults.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
from collections.abc import Mapping, Sequence

PARITY_STEPS = 10  # the parity check reads the losses of the first steps, warmup included
PARITY_TOL = 1e-6  # the largest loss difference from the reference's allowed there


def hold_heap() -> bool:
    """Keep this process's freed memory in its heap (glibc's mallopt: no trimming, the mmap
    threshold fixed at 32 MiB); False where that cannot be done (no glibc). Two systems timed
    in one process share its heap. By default glibc hands freed memory back to the OS at
    thresholds that follow what was freed last, so one system's step pays page faults that
    depend on the other's buffers: TorchRec's sequence step ran about 10% slower or faster
    depending on the size of hybridrec's (benchmarks/results/issue39_sequence_bench.md).
    Call it in each process before either system runs."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    trim = libc.mallopt(m_trim_threshold, 2**31 - 1)
    return bool(trim and libc.mallopt(m_mmap_threshold, 32 << 20))


HEAPS = {  # --heap's choices: what each means, as the reports say it
    "held": "held (each process's freed memory stays in its heap: benchmarks.paired.hold_heap)",
    "default": "glibc's default (freed memory trimmed back to the OS)",
}


def heap_option(parser: argparse.ArgumentParser) -> None:
    """The --heap option of a benchmark that pairs systems inside one process."""
    parser.add_argument(
        "--heap",
        choices=tuple(HEAPS),
        default="held",
        help="held: each process keeps its freed memory in its heap (hold_heap), so neither "
        "system pays page faults the other's buffers caused; default: glibc's own",
    )


def use_heap(choice: str) -> None:
    """Apply --heap in this process (each rank calls it before either system runs)."""
    if choice == "held" and not hold_heap():
        raise RuntimeError("--heap held needs glibc's mallopt; run with --heap default")


def step_order(systems: Sequence[str], step: int) -> list[str]:
    """The order the systems run in at `step`: as given on even steps, reversed on odd ones,
    so each pair meets in both orders equally often."""
    return list(systems) if step % 2 == 0 else list(reversed(systems))


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per step, the slowest rank's time (ranks meet at every exchange)."""
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def paired_ratio(theirs: Sequence[float], ours: Sequence[float]) -> tuple[float, float, float]:
    """(median, first quartile, third quartile) over steps of theirs[i] / ours[i]: each step's
    pair ran back to back, so load that comes and goes divides out."""
    ratios = sorted(t / o for t, o in zip(theirs, ours, strict=True))
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return statistics.median(ratios), q1, q3


def loss_gaps(
    per_rank: Sequence[Mapping[str, Sequence[float]]], reference: str, steps: int | None
) -> dict[str, tuple[float, int]]:
    """Per system but `reference`: (the largest |its loss - the reference's| over the first
    `steps` steps (None: all) on any rank, the step it was at). NaN counts as a gap."""
    out = {}
    for name in per_rank[0]:
        if name == reference:
            continue
        worst = (0.0, 0)
        for losses in per_rank:
            pairs = list(zip(losses[reference], losses[name], strict=True))[:steps]
            for i, (a, b) in enumerate(pairs):
                if not abs(a - b) <= worst[0]:
                    worst = (abs(a - b), i)
        out[name] = worst
    return out


def parity_failures(
    label: str,
    gaps: Mapping[str, tuple[float, int]],
    names: Mapping[str, str],
    reference: str,
    tol: float = PARITY_TOL,
) -> list[str]:
    """One line per system whose loss gap (loss_gaps over PARITY_STEPS) exceeds `tol`."""
    return [
        f"parity failed: {label}, {names[name]}: its loss differs from {reference}'s by "
        f"{gap:.1e} at step {step} (> {tol:.0e} within the first {PARITY_STEPS} steps): the "
        "systems do not train the same model, so their times do not compare"
        for name, (gap, step) in gaps.items()
        if not gap <= tol
    ]


def median_ci(xs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of `xs` (order statistics: the
    k-th smallest and k-th largest, k the largest with P(Binomial(n, 1/2) < k) <= (1 -
    level) / 2); (min, max) when there are too few values for `level`. Where a paired
    ratio's interval holds 1.0, the two systems' speeds are not told apart by the run."""
    s, n = sorted(xs), len(xs)
    tail, k, below = (1.0 - level) / 2.0, 0, 0.0
    while k < n // 2 and below + math.comb(n, k) / 2.0**n <= tail:
        below += math.comb(n, k) / 2.0**n
        k += 1
    if k == 0:
        return s[0], s[-1]
    return s[k - 1], s[n - k]
