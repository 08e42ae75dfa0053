"""Two commits of hybridrec, the same model, paired step times: is the new one slower?

    python -m benchmarks.commits --base 56fa775 --new HEAD --steps 30 --warmup 5 \\
        --out benchmarks/results/issue38_paired.md

`--base` and `--new` each name a commit (checked out here as a detached `git worktree` in a
temp dir, removed at the end; `git worktree prune` clears one a killed run left) or a
directory that already holds a checkout. For every case (a benchmark's model, a world size W,
a variant) the tool starts, per side, W rank processes
with cwd and PYTHONPATH at that side's checkout, each running benchmarks/commits_driver.py's
source: so each side builds its config with its own commit's benchmark code (sharding_gloo's
make_cfg, dynamic_step's make_cfg and make_batches) and trains it with its own commit's
Trainer. W ranks of one side form their own gloo group (a one-rank group at W=1, as
sharding_gloo runs its W=1 rows; no group for sharding=none and dynamic_step, as those
benchmarks run them).

Then it steps the two sides in lockstep from here: at every step one side runs
`Trainer.train_step` on its batch (all its ranks together, after a barrier), then the other,
in alternating order (paired.step_order), so each step's pair of times met the same load on
this machine. A side's step time is its slowest rank's. The result is the median of the
per-step ratios new / base with its quartiles (paired.paired_ratio) and a 95% interval of that
median (paired.median_ci), for the wall time and for the CPU time of the step's process
(time.process_time: on a machine with more runnable processes than cores, the wall time is
mostly the wait for a core, the CPU time the work). A comparison means something only if
both sides trained the same model on the same data: every rank's batches must hash equal on
both sides, and every rank's loss at every step (warmup included) must agree within
--loss-rtol (default 1e-7 relative); the table gives the largest gap, and the run exits 1 if
any case fails either check.

Cases:
- sharding_gloo (`--sharding-modes`, `--sharding-worlds`, `--sharding-args`): its default model
  `mid` (8 tables, 1e3..1e6 rows, dim 32; change it with e.g. --sharding-args "--model
  dlrm_tiny"), one row per mode and W; `none` (its single-process reference) only at W=1.
- dynamic_step (`--dynamic`, `--dynamic-args`): its model with dynamic tables (`dynamic`, raw
  40-bit ids admitted and evicted every step) and the fixed tables it compares with (`fixed`),
  W=1 only (the benchmark is single-process).
The `--*-args` strings go to that benchmark's own argument parser at each commit.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import (
    command_line,
    cpu_seconds,
    hardware,
    host_cores,
    load_average,
    markdown_table,
    median,
)
from benchmarks.paired import median_ci, paired_ratio, slowest, step_order

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("commits_driver.py")
SHARDING_MODES = ("none", "table_wise", "column_wise", "row_wise", "data_parallel", "auto")
DYNAMIC_VARIANTS = ("dynamic", "fixed")
SIDES = ("base", "new")


@dataclass(frozen=True)
class Case:
    """One row: a benchmark's model at one world size in one variant."""

    bench: str  # "sharding_gloo" | "dynamic_step"
    variant: str  # a sharding mode, or "dynamic" | "fixed"
    world: int
    args: tuple[str, ...]  # the benchmark's own command-line arguments

    @property
    def label(self) -> str:
        return f"{self.bench} {self.variant} W={self.world}"

    @property
    def grouped(self) -> bool:
        """Whether its ranks join a gloo group (as the benchmark itself runs this row)."""
        return self.bench == "sharding_gloo" and self.variant != "none"


@dataclass
class Checkout:
    """A side's source tree: where it is and what it is."""

    path: Path
    # 'abc1234 subject' (cut at 60 characters; a directory's HEAD, '+ uncommitted changes')
    label: str
    worktree: bool  # made here (removed at the end)


@dataclass
class Rank:
    """One rank process of one side, its protocol lines read by a thread into a queue."""

    proc: subprocess.Popen
    log: Path
    lines: queue.Queue = field(default_factory=queue.Queue)

    def start_reader(self) -> None:
        def read() -> None:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                self.lines.put(line)
            self.lines.put(None)  # end of output: the process exited

        threading.Thread(target=read, daemon=True).start()

    def send(self, msg: dict) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def receive(self, timeout: float, what: str) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{what}: no answer within {timeout:.0f} s; {self.tail()}") from None
        if line is None:
            self.proc.wait()
            raise RuntimeError(f"{what}: exited with {self.proc.returncode}; {self.tail()}")
        return json.loads(line)

    def tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"its stderr ({self.log}) ends:\n{text[-3000:]}"


class Side:
    """The W rank processes of one checkout for one case."""

    def __init__(self, name: str, checkout: Checkout, case: Case, steps: int, tmp: Path) -> None:
        self.name, self.checkout, self.case = name, checkout, case
        env = {**os.environ, "PYTHONPATH": str(checkout.path), "OMP_NUM_THREADS": "1"}
        driver = tmp / DRIVER.name  # a copy outside every checkout: its imports are the side's
        if not driver.exists():
            shutil.copyfile(DRIVER, driver)
        init = f"file://{tmp}/{name}_rendezvous" if case.grouped else None
        self.ranks: list[Rank] = []
        for r in range(case.world):
            spec = {"bench": case.bench, "variant": case.variant, "world": case.world}
            spec |= {"rank": r, "init": init, "steps": steps, "args": list(case.args)}
            log = tmp / f"{name}_rank{r}.log"
            with open(log, "w") as err:
                proc = subprocess.Popen(
                    [sys.executable, str(driver), json.dumps(spec)],
                    cwd=checkout.path,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
            self.ranks.append(Rank(proc, log))
            self.ranks[-1].start_reader()
        self.ready: list[dict] = []

    def wait_ready(self, timeout: float) -> None:
        self.ready = [
            rk.receive(timeout, f"{self.name} rank {r} ({self.case.label}) starting")
            for r, rk in enumerate(self.ranks)
        ]
        for r, info in enumerate(self.ready):
            got, want = Path(info["hybridrec"]).resolve(), self.checkout.path.resolve()
            if not got.is_relative_to(want):
                raise RuntimeError(
                    f"{self.name} rank {r} imported hybridrec from {got}, not from its "
                    f"checkout {want}: is hybridrec installed non-editable in {sys.executable}?"
                )

    def step(self, i: int, timeout: float) -> list[dict]:
        """Per rank, step i's {"t": wall seconds, "cpu": CPU seconds, "loss": local loss}."""
        for rk in self.ranks:
            rk.send({"step": i})
        what = f"{self.name} ({self.case.label}) step {i}"
        out = [rk.receive(timeout, f"{what}, rank {r}") for r, rk in enumerate(self.ranks)]
        return out

    def close(self, kill: bool = False) -> None:
        """Ask every rank to quit (kill: end them now, after a failure or an interrupt)."""
        for rk in self.ranks:
            if kill and rk.proc.poll() is None:
                rk.proc.kill()
            elif rk.proc.poll() is None:
                try:
                    rk.send({"quit": True})
                except OSError:
                    pass
        for rk in self.ranks:
            try:
                rk.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                rk.proc.kill()
                rk.proc.wait()


# -- checkouts -----------------------------------------------------------------------------
def _git(cwd: Path, *args: str) -> str:
    run = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {cwd} failed: {run.stderr.strip()}")
    return run.stdout.strip()


def checkout(ref: str, tmp: Path, name: str) -> Checkout:
    """`ref` as a checkout: a directory as it is, or a commit as a detached worktree in tmp."""
    if Path(ref).is_dir():
        path = Path(ref).resolve()
        if not (path / "hybridrec").is_dir() or not (path / "benchmarks").is_dir():
            raise SystemExit(
                f"--{name} {ref}: not a hybridrec checkout (no hybridrec/, benchmarks/)"
            )
        try:
            head = _git(path, "log", "-1", "--format=%h %<(60,trunc)%s").rstrip()
            dirty = _git(path, "status", "--porcelain", "--untracked-files=no")
        except RuntimeError:
            return Checkout(path, f"{path} (not a git checkout)", False)
        return Checkout(path, head + (" + uncommitted changes" if dirty else ""), False)
    try:
        sha = _git(ROOT, "rev-parse", "--verify", f"{ref}^{{commit}}")
    except RuntimeError:
        raise SystemExit(
            f"--{name} {ref}: neither a directory nor a commit of the repository at {ROOT}"
        ) from None
    path = tmp / f"{name}_{sha[:10]}"
    _git(ROOT, "worktree", "add", "--detach", str(path), sha)
    return Checkout(path, _git(path, "log", "-1", "--format=%h %<(60,trunc)%s").rstrip(), True)


def remove(co: Checkout) -> None:
    """Remove a worktree made here (its directory and git's record of it)."""
    if not co.worktree:
        return
    run = subprocess.run(
        ["git", "worktree", "remove", "--force", str(co.path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        print(f"could not remove worktree {co.path}: {run.stderr.strip()}", file=sys.stderr)


# -- one case ------------------------------------------------------------------------------
def loss_gap(base: list[list[float]], new: list[list[float]]) -> tuple[float, float]:
    """(largest |base - new|, largest |base - new| / |base|) over steps x ranks; a NaN on
    either side, or a gap where base is 0, makes the gap inf."""
    gap, rel = 0.0, 0.0
    for lb, ln in zip(base, new, strict=True):
        for a, b in zip(lb, ln, strict=True):
            d = abs(a - b) if a == a and b == b else float("inf")
            gap = max(gap, d)
            rel = max(rel, d / abs(a) if a else (0.0 if d == 0 else float("inf")))
    return gap, rel


def run_case(case: Case, checkouts: dict[str, Checkout], args: argparse.Namespace) -> dict:
    """Both sides of one case, stepped in lockstep; its row's numbers and checks."""
    total = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="commits_") as tmp:
        sides: dict[str, Side] = {}
        done = False
        try:
            for s in SIDES:
                sides[s] = Side(s, checkouts[s], case, total, Path(tmp))
            for side in sides.values():
                side.wait_ready(args.timeout)
            # per side, per rank, per timed step: wall and CPU seconds
            wall = {s: [[] for _ in range(case.world)] for s in SIDES}
            cpu = {s: [[] for _ in range(case.world)] for s in SIDES}
            losses: dict[str, list[list[float]]] = {s: [] for s in SIDES}
            for i in range(total):
                for s in step_order(SIDES, i):
                    out = sides[s].step(i, args.timeout)
                    if i >= args.warmup:
                        for r, o in enumerate(out):
                            wall[s][r].append(o["t"])
                            cpu[s][r].append(o["cpu"])
                    losses[s].append([o["loss"] for o in out])
            ready = {s: sides[s].ready for s in SIDES}
            done = True
        finally:
            for side in sides.values():
                side.close(kill=not done)
    times = {s: slowest(wall[s]) for s in SIDES}  # a step takes its slowest rank's time
    cpus = {s: slowest(cpu[s]) for s in SIDES}
    ratio = paired_ratio(times["new"], times["base"])
    ci = median_ci([n / b for n, b in zip(times["new"], times["base"], strict=True)])
    cpu_ratios = [n / b for n, b in zip(cpus["new"], cpus["base"], strict=True)]
    gap, rel = loss_gap(losses["base"], losses["new"])
    same_batches = all(
        rb["digests"] == rn["digests"] for rb, rn in zip(ready["base"], ready["new"], strict=True)
    )
    problems = []
    if not same_batches:
        problems.append("the sides' batches differ")
    if not rel <= args.loss_rtol:
        problems.append(f"losses differ by {rel:.1e} relative (> {args.loss_rtol:.0e})")
    native = {s: all(r["native"] for r in ready[s]) for s in SIDES}
    if native["base"] != native["new"]:
        problems.append(f"C kernels loaded: base {native['base']}, new {native['new']}")
    plans = {s: ready[s][0]["plan"] for s in SIDES}
    plan = plans["new"] if plans["new"] == plans["base"] else f"{plans['base']} -> {plans['new']}"
    return {
        "case": case,
        "ms": {s: 1e3 * median(times[s]) for s in SIDES},
        "ratio": ratio,
        "ci": ci,
        "cpu_ms": {s: 1e3 * median(cpus[s]) for s in SIDES},
        "cpu_ratio": median(cpu_ratios),
        "cpu_ci": median_ci(cpu_ratios),
        "gap": gap,
        "rel": rel,
        "last_loss": losses["new"][-1][0],
        "plan": plan,
        "native": native["new"],
        "problems": problems,
    }


# -- main ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(
            "Paired step times of two commits (or checkouts) of hybridrec on the same model and "
            "batches: sharding_gloo's and dynamic_step's models, every step both sides back to "
            "back in alternating order; the median per-step ratio new/base, and the losses of "
            "both, which must agree."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base", required=True, help="commit, or directory holding a checkout")
    p.add_argument("--new", required=True, help="commit, or directory holding a checkout")
    p.add_argument(
        "--sharding-modes",
        default="table_wise,column_wise,row_wise,data_parallel,auto",
        help=f"sharding_gloo rows, from {','.join(SHARDING_MODES)} ('' for none; 'none' runs "
        "at W=1 only)",
    )
    p.add_argument("--sharding-worlds", default="1,2", help="world sizes of the sharding rows")
    p.add_argument(
        "--sharding-args",
        default="",
        help="arguments for sharding_gloo's own parser, e.g. '--model dlrm_tiny --batch-size 1024'",
    )
    p.add_argument(
        "--dynamic",
        default="dynamic,fixed",
        help="dynamic_step rows (W=1): dynamic, fixed ('' for none)",
    )
    p.add_argument(
        "--dynamic-args",
        default="",
        help="arguments for dynamic_step's own parser, e.g. '--capacities 4096,1024'",
    )
    p.add_argument("--steps", type=int, default=30, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (losses checked)")
    p.add_argument(
        "--loss-rtol", type=float, default=1e-7, help="largest relative loss gap allowed"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds a rank may take to answer")
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    modes = [m for m in args.sharding_modes.split(",") if m]
    worlds = [int(w) for w in args.sharding_worlds.split(",") if w]
    variants = [v for v in args.dynamic.split(",") if v]
    for m in modes:
        if m not in SHARDING_MODES:
            p.error(f"--sharding-modes: unknown mode {m!r}; choose from {SHARDING_MODES}")
    for v in variants:
        if v not in DYNAMIC_VARIANTS:
            p.error(f"--dynamic: unknown variant {v!r}; choose from {DYNAMIC_VARIANTS}")
    if any(w < 1 for w in worlds):
        p.error(f"--sharding-worlds {args.sharding_worlds}: world sizes are at least 1")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    sharding = tuple(shlex.split(args.sharding_args))
    dynamic = tuple(shlex.split(args.dynamic_args))
    args.cases = [
        Case("sharding_gloo", m, w, sharding)
        for w in worlds
        for m in modes
        if m != "none" or w == 1
    ] + [Case("dynamic_step", v, 1, dynamic) for v in variants]
    if not args.cases:
        p.error("no cases: give --sharding-modes or --dynamic")
    return args


def row(r: dict) -> list[object]:
    c: Case = r["case"]
    med, q1, q3 = r["ratio"]
    gap = "0 (exact)" if r["gap"] == 0 else f"{r['gap']:.1e} ({r['rel']:.1e} rel)"
    return [
        c.bench,
        c.variant,
        c.world,
        r["plan"],
        f"{r['ms']['base']:.1f}",
        f"{r['ms']['new']:.1f}",
        f"**{med:.3f}**",
        f"{q1:.3f}..{q3:.3f}",
        f"{r['ci'][0]:.3f}..{r['ci'][1]:.3f}",
        f"{r['cpu_ms']['base']:.1f} / {r['cpu_ms']['new']:.1f}",
        f"**{r['cpu_ratio']:.3f}**",
        f"{r['cpu_ci'][0]:.3f}..{r['cpu_ci'][1]:.3f}",
        gap,
        f"{r['last_loss']:.6f}",
        "; ".join(r["problems"]) or "ok",
    ]


HEADERS = [
    "benchmark",
    "variant",
    "W",
    "plan",
    "base ms",
    "new ms",
    "new/base (median)",
    "quartiles",
    "95% CI of median",
    "CPU ms base / new",
    "CPU new/base (median)",
    "its 95% CI",
    "largest loss gap",
    "last loss",
    "checks",
]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    host, command = hardware(), command_line()
    load = [load_average()]
    busy_0, own_0, wall_0 = *cpu_seconds(), time.perf_counter()
    print(f"# {host}; load average {load[0]}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="commits_trees_") as tmp:
        checkouts: dict[str, Checkout] = {}
        try:
            for s in SIDES:
                checkouts[s] = checkout(getattr(args, s), Path(tmp), s)
                print(f"{s}: {checkouts[s].label} ({checkouts[s].path})", flush=True)
            for case in args.cases:
                r = run_case(case, checkouts, args)
                results.append(r)
                print(" | ".join(str(c) for c in row(r)), flush=True)
        finally:
            for co in checkouts.values():
                remove(co)
    load.append(load_average())
    busy_1, own_1, wall_1 = *cpu_seconds(), time.perf_counter()
    wall = wall_1 - wall_0
    others = max(0.0, (busy_1 - busy_0) - (own_1 - own_0))
    load.append(
        f"other processes used {others:.0f} CPU-seconds during the {wall:.0f} s run "
        f"({100 * others / (wall * host_cores()):.0f}% of the host's {host_cores()} cores)"
    )
    table = markdown_table(HEADERS, [row(r) for r in results])
    print()
    print(table)
    print(f"\nload average {load[0]} at start, {load[1]} at end; {load[2]}")
    failed = [r for r in results if r["problems"]]
    if args.out is not None:
        write_report(args, host, command, checkouts, table, load, results)
    for r in failed:
        print(f"FAILED: {r['case'].label}: {'; '.join(r['problems'])}", file=sys.stderr)
    return 1 if failed else 0


def write_report(
    args: argparse.Namespace,
    host: str,
    command: str,
    checkouts: dict[str, Checkout],
    table: str,
    load: list[str],
    results: list[dict],
) -> None:
    native = (
        "loaded on both sides" if all(r["native"] for r in results) else "NOT loaded everywhere"
    )
    text = f"""# Two commits, paired step times

Command (from the repository root):

```bash
{command}
```

- Machine: {host}.
- Base: {checkouts["base"].label}. New: {checkouts["new"].label}.
- Host load during the run: {load[2]}. Load average (1, 5, 15 min): {load[0]} before, {load[1]}
  after (this run included).
- Per case and side, fresh rank processes (one torch thread each) at that side's checkout
  build the model with its own commit's code (`benchmarks/commits_driver.py`); the C kernels
  were {native}. {args.warmup} warmup steps, then {args.steps} timed steps. Every step both
  sides run `Trainer.train_step` back to back (all ranks of a side after a barrier; its time is
  its slowest rank's), alternating which goes first.
- **new/base**: the median over steps of the per-step ratio new / base (each pair met the same
  load); **quartiles** of those ratios; **95% CI of median**: a distribution-free interval of
  that median (order statistics). Where it holds 1.00, the run does not tell the commits apart.
  **base ms / new ms**: each side's median step time (loaded machine: read the ratio).
- **CPU**: the same for the CPU time the step's process used (`time.process_time`, all its
  threads; the slowest rank's), which leaves out the time it waited for a core: on a machine
  busier than its cores, the steadier measure of the work each commit does per step (it
  still counts cache and memory stalls that other processes cause, and no time a rank spent
  blocked on its peer).
- **largest loss gap**: the largest |loss_base - loss_new| over every rank and step (warmup
  included), relative in parentheses; allowed: {args.loss_rtol:.0e} relative. **checks**: the
  sides' batches hash equal on every rank, the losses agree, both loaded the C kernels.

{table}
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
