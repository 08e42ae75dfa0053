"""CPU embedding work on a table in 4 KiB pages vs the same table in transparent huge pages.

    OMP_NUM_THREADS=1 python -m benchmarks.huge_pages --out benchmarks/results/huge_pages_cpu.md

Issue 22's model: 8 tables of 1K-1M rows (2.44M rows x 32, 312 MB fp32) in one weight, as
one CPU process holds it, and global batches of 4096 Zipf(1.05) ids per table. Two copies of
the weight, one left to the default pages and one given hybridrec.kernels.pages.huge_pages
before it was written; per step and copy, in turn: a pass over 64 MB of other memory (the
dense part's share of the caches in a training step), then the pooled lookup
(torch embedding_bag), the gradient dedupe (hybridrec's C kernel, which reads no table rows:
a control) and the SGD row update (C kernel). Medians over the steps; the ratio is default
pages over huge pages (> 1: huge pages faster). Needs Linux with transparent huge pages in
"madvise" or "always" mode (it says so and stops otherwise).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import command_line, git_state, hardware, markdown_table, median
from benchmarks.lookup_update import zipf_ids
from hybridrec.kernels import native
from hybridrec.kernels.pages import huge_pages

SIZES = (1000, 3000, 10_000, 30_000, 100_000, 300_000, 1_000_000, 1_000_000)
PHASES = ("lookup", "dedupe", "sgd update")


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unavailable"
    return text.split("[")[1].split("]")[0] if "[" in text else text.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="rows per table")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batches", type=int, default=10, help="distinct batches, cycled")
    p.add_argument("--evict-mb", type=int, default=64, help="memory swept before each step")
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    mode = _thp_mode()
    if mode not in ("madvise", "always"):
        print(f"huge_pages: transparent huge pages are {mode!r} here; nothing to compare")
        return 2
    if native.lib() is None:
        print("huge_pages: the C kernels are not available (no compiler?)", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    rows_total, dim, b = sum(sizes), args.dim, args.batch_size
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for label, advise in (("default pages", False), ("huge pages", True)):
        w = torch.empty(rows_total, dim)
        if advise and not huge_pages(w):
            print("huge_pages: madvise refused", file=sys.stderr)
            return 2
        weights[label] = w.normal_(0, 0.01, generator=gen)
    start = torch.tensor([0, *sizes]).cumsum(0)[:-1]
    batches = []
    for _ in range(args.batches):
        ids = torch.stack([zipf_ids(n, b, 1.05, gen, torch.device("cpu")) for n in sizes], 1)
        batches.append((ids + start).reshape(-1).contiguous())  # sample-major, as one rank
    n = batches[0].numel()
    offsets, bags = torch.arange(n), torch.arange(n)
    grad = torch.randn(n, dim, generator=gen)
    sweep = torch.zeros(args.evict_mb << 18)
    times = {label: {ph: [] for ph in PHASES} for label in weights}
    for step in range(args.steps + 3):
        rows = batches[step % len(batches)]
        for label, w in weights.items():
            sweep.add_(1.0)
            t0 = time.perf_counter()
            torch.nn.functional.embedding_bag(rows, w, offsets, mode="sum")
            t1 = time.perf_counter()
            unique_rows, grads = native.dedupe_hashed(rows, bags, None, grad)
            t2 = time.perf_counter()
            native.row_update("hr_sgd", w, [], unique_rows, grads, None, (1e-3,))
            t3 = time.perf_counter()
            if step >= 3:
                for ph, t in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    times[label][ph].append(t)
    rows_out = []
    for ph in PHASES:
        a = median(times["default pages"][ph]) * 1e3
        h = median(times["huge pages"][ph]) * 1e3
        rows_out.append([ph, f"{a:.3f}", f"{h:.3f}", f"{a / h:.2f}"])
    total_a = sum(median(times["default pages"][ph]) for ph in PHASES) * 1e3
    total_h = sum(median(times["huge pages"][ph]) for ph in PHASES) * 1e3
    rows_out.append(["all three", f"{total_a:.3f}", f"{total_h:.3f}", f"{total_a / total_h:.2f}"])
    table = markdown_table(["phase", "default pages ms", "huge pages ms", "ratio"], rows_out)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            "# CPU embedding work: default pages vs transparent huge pages\n\n"
            f"Command: `{command_line()}`\n\n- Hardware: {hardware()}; "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; transparent huge "
            f"pages: {mode}\n- Git: {git_state()}\n- {len(sizes)} tables of {sizes} rows, dim "
            f"{dim}, {b} ids per table and step ({n} in all), Zipf 1.05; median of "
            f"{args.steps} steps, the two weights in turn, {args.evict_mb} MB swept before "
            "each. Method: the docstring of benchmarks/huge_pages.py.\n\n"
            f"{table}\n"
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
