"""Exact mode's cost on CPU/gloo: the default step and the exact step of one model, paired.

    python -m benchmarks.exact_cost --out benchmarks/results/exact_cost_cpu.md

For every model (`dlrm_tiny` and sharding_gloo's `mid`: 8 tables of 1e3..1e6 rows, dim 32) and
world size W (1 and 2), W gloo processes (tests/distributed/harness.py, one torch thread each)
each build two Trainers from the same config (sharding_gloo.make_cfg), one in the default
mode and one with train.exact=true (train.exact_shards micro-shards, docs/exact.md), and step
them in turn on the same global batches: at every step one mode, then the other, in
alternating order (paired.step_order), each after a barrier. A step's time is the slowest
rank's. Both modes' steps therefore meet the same load on a shared machine, and the ratio of
each pair divides it out: the table gives the median of the per-step ratios exact / default
with its quartiles and a 95% interval of that median (paired.median_ci), for the CPU time of
the step's process (time.process_time, all its threads: on a machine with more runnable
processes than cores the wall time is mostly the wait for a core) and for the wall time.

Memory, in separate processes (one per model, W and mode, so one mode's freed memory cannot
serve the other): the resident set after the model is built, and the peak resident set over
`--memory-steps` steps on top of it (the high-water mark reset after the build through
/proc/self/clear_refs), the largest over ranks. Exact mode holds M/W micro-shards' partial
dense gradients at once (M * P / W values for P dense parameters), or all M of them where
its collective gathers them (M * P <= 2^20 values: hybridrec.distributed.exact_sum), also
given.

Parity: exact mode at W=1 and W=2 must give the same loss, bit for bit, at every step
(timed and warmup); the default mode must be close to exact mode (the largest relative gap
over the steps is shown; they add the same terms in another order). The run exits 1 if
exact mode's losses differ between world sizes.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch.distributed as dist

from benchmarks import sharding_gloo
from benchmarks.common import (
    command_line,
    cpu_seconds,
    git_state,
    hardware,
    host_cores,
    load_average,
    markdown_table,
    median,
)
from benchmarks.paired import median_ci, paired_ratio, slowest, step_order
from hybridrec.config import Config
from hybridrec.distributed import DistEnv
from hybridrec.distributed.exact_sum import gathers_all
from hybridrec.train.trainer import Trainer
from tests.distributed.harness import spawn

MODES = ("default", "exact")


def make_cfgs(args: argparse.Namespace, model: str, world: int) -> dict[str, Config]:
    """The two configs of one (model, W): sharding_gloo's, and the same with train.exact."""
    bench = argparse.Namespace(**{**vars(args), "model": model})
    default = sharding_gloo.make_cfg(bench, args.sharding, world)
    bench.override = [
        *args.override,
        "train.exact=true",
        f"train.exact_shards={args.exact_shards}",
    ]
    return {"default": default, "exact": sharding_gloo.make_cfg(bench, args.sharding, world)}


# -- one rank --------------------------------------------------------------------------------
def paired_steps(env: DistEnv, cfgs: dict[str, Config], steps: int, warmup: int) -> dict:
    """Both modes' Trainers on this rank, stepped in turn on the same batches: per mode the
    wall and CPU seconds of every timed step and the global loss of every step."""
    trainers = {m: Trainer(cfgs[m], env) for m in MODES}
    batches = {m: [t.train_batch(s) for s in range(warmup + steps)] for m, t in trainers.items()}
    out = {m: {"t": [], "cpu": [], "loss": []} for m in MODES}
    for i in range(warmup + steps):
        for m in step_order(MODES, i):
            if env.group is not None:
                dist.barrier(group=env.group)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = trainers[m].train_step(batches[m][i])
            t, c = time.perf_counter() - t0, time.process_time() - c0
            if i >= warmup:
                out[m]["t"].append(t)
                out[m]["cpu"].append(c)
            out[m]["loss"].append(trainers[m].global_mean(loss))
    return out


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def memory(env: DistEnv, cfg: Config, steps: int) -> dict:
    """This rank's resident set after the build and its peak over `steps` steps (KiB)."""
    trainer = Trainer(cfg, env)
    batches = [trainer.train_batch(s) for s in range(steps)]
    gc.collect()
    built = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)
    for b in batches:
        trainer.train_step(b)
    dense = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"built": built, "peak": _status_kib("VmHWM"), "dense_params": dense}


# -- the report ------------------------------------------------------------------------------
def ratio_cells(exact: list[float], default: list[float]) -> list[str]:
    """'1.12 (1.05-1.20)' and its 95% interval '[1.08, 1.15]': median paired ratio."""
    med, q1, q3 = paired_ratio(exact, default)
    lo, hi = median_ci([e / d for e, d in zip(exact, default, strict=True)])
    return [f"{med:.2f} ({q1:.2f}-{q3:.2f})", f"[{lo:.2f}, {hi:.2f}]"]


def rel_gap(a: list[float], b: list[float]) -> tuple[float, int]:
    """(the largest |a - b| / |a| over steps, its step)."""
    gaps = [abs(x - y) / abs(x) for x, y in zip(a, b, strict=True)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return gaps[worst], worst


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Exact mode's step time and memory against the default mode, paired.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--models", default="dlrm_tiny,mid", help="'mid' or conf/model names")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated; the first is parity's")
    p.add_argument("--sharding", default="auto", help="the sharding mode of both modes")
    p.add_argument("--exact-shards", type=int, default=8, help="train.exact_shards")
    p.add_argument("--batch-size", type=int, default=4096, help="global batch")
    p.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per mode first")
    p.add_argument("--memory-steps", type=int, default=3, help="steps of the memory runs (0: none)")
    p.add_argument("--optimizer", default="sgd", choices=sorted(sharding_gloo.SPARSE_LR))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--timeout", type=float, default=900, help="seconds per spawn")
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    for w in args.world_sizes:
        if args.exact_shards % w or args.batch_size % args.exact_shards:
            p.error(
                f"--exact-shards {args.exact_shards} must be a multiple of every world size "
                f"({w}) and divide --batch-size {args.batch_size}"
            )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    host, code, load = hardware(), git_state(), [load_average()]
    busy_0, own_0, wall_0 = *cpu_seconds(), time.perf_counter()
    print(f"# {host}; load average {load[0]}", flush=True)
    rows, mem_rows, parity, failures = [], [], [], []
    for model in args.models:
        exact_losses = {}
        for world in args.world_sizes:
            cfgs = make_cfgs(args, model, world)
            ranks = spawn(world, paired_steps, cfgs, args.steps, args.warmup, timeout=args.timeout)
            t = {m: slowest([r[m]["t"] for r in ranks]) for m in MODES}
            cpu = {m: slowest([r[m]["cpu"] for r in ranks]) for m in MODES}
            losses = {m: ranks[0][m]["loss"] for m in MODES}
            exact_losses[world] = losses["exact"]
            gap, at = rel_gap(losses["default"], losses["exact"])
            rows.append(
                [model, world, f"{median(cpu['default']) * 1e3:.1f}"]
                + [f"{median(cpu['exact']) * 1e3:.1f}", *ratio_cells(cpu["exact"], cpu["default"])]
                + [f"{median(t['default']) * 1e3:.1f}", f"{median(t['exact']) * 1e3:.1f}"]
                + ratio_cells(t["exact"], t["default"])
                + [f"{gap:.1e} (step {at})"]
            )
            print(markdown_table(HEAD, rows[-1:]).splitlines()[-1], flush=True)
            for mode in MODES if args.memory_steps else ():
                mem = spawn(world, memory, cfgs[mode], args.memory_steps, timeout=args.timeout)
                built = max(r["built"] for r in mem) / 1024
                peak = max(r["peak"] - r["built"] for r in mem) / 1024
                dense = mem[0]["dense_params"]
                partials = 1
                if mode == "exact":  # M/W partials, or all M once gathered (exact_all_reduce)
                    per_rank = args.exact_shards // world
                    gathered = world > 1 and gathers_all(world, per_rank, dense)
                    partials = args.exact_shards if gathered else per_rank
                values = dense * partials
                mem_rows.append([model, world, mode, f"{built:.0f}", f"{peak:.1f}", f"{values:,}"])
            gc.collect()
            load.append(load_average())
        base = args.world_sizes[0]
        for world in args.world_sizes[1:]:
            same = exact_losses[world] == exact_losses[base]
            n = len(exact_losses[base])
            parity.append(
                f"- {model}: exact mode's {n} losses at W={world} "
                + (f"equal W={base}'s, bit for bit" if same else "DIFFER")
            )
            if not same:
                failures.append(f"{model}: exact W={world} losses differ from W={base}")
    busy_1, own_1, wall_1 = *cpu_seconds(), time.perf_counter()
    other = (busy_1 - busy_0) - (own_1 - own_0)
    text = report(args, host, code, load, rows, mem_rows, parity, other / (wall_1 - wall_0))
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    for f in failures:
        print(f"parity failed: {f}", file=sys.stderr)
    return 1 if failures else 0


HEAD = [
    "model",
    "W",
    "default CPU ms",
    "exact CPU ms",
    "CPU exact/default (IQR)",
    "95% CI",
    "default wall ms",
    "exact wall ms",
    "wall exact/default (IQR)",
    "wall 95% CI",
    "largest rel. loss gap default vs exact",
]
MEM_HEAD = ["model", "W", "mode", "RSS after build MiB", "step peak above it MiB", "grad values"]


def report(args, host, code, load, rows, mem_rows, parity, other_cores) -> str:
    return "\n".join(
        [
            "# Exact mode's cost on CPU/gloo (benchmarks/exact_cost.py)",
            "",
            "```bash",
            command_line(),
            "```",
            "",
            f"- Machine: {host}",
            f"- Commit: {code}",
            f"- Load average (1, 5, 15 min) before and after each (model, W): {', '.join(load)}",
            f"- Host load during the run: other processes used {other_cores:.2f} of "
            f"{host_cores()} cores on average",
            f"- sharding={args.sharding}, global batch {args.batch_size}, train.exact_shards="
            f"{args.exact_shards}, sparse {args.optimizer}, {args.steps} timed steps after "
            f"{args.warmup} warmup per mode, one torch thread per rank; a step's time is the "
            "slowest rank's; ratios are medians of per-step pairs (exact / default)",
            "",
            "## Step time",
            "",
            markdown_table(HEAD, rows),
            "",
            "## Memory (separate processes, the largest rank)",
            "",
            "grad values: dense gradient values a rank holds at once (P, or exact mode's M/W "
            "partials of P, all M once gathered).",
            "",
            markdown_table(MEM_HEAD, mem_rows),
            "",
            "## Parity",
            "",
            *parity,
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
