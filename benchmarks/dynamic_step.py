"""A training step with dynamic tables vs the same model with fixed tables of the same
capacity, paired in one process (issue 33's speed goal: dynamic <= 1.3x fixed on the CPU).

    python -m benchmarks.dynamic_step --out benchmarks/results/dynamic_step_cpu.md

The model: DLRM (dlrm_tiny's MLPs, width 16) over tables of `--capacities` rows, trained with
`--optimizer`. Both systems read the same pre-generated batches (dense features and labels from
the synthetic source; data loading is not timed): each table's ids are Zipf-distributed over
a universe of `--universe` x its capacity distinct ids, which
- the dynamic system sees as raw 40-bit ids (a fixed random bijection of the rank), mapped to
  its `capacity` slots by the policy (`--evict`, admit always): more ids than slots, so
  admission and eviction run every step;
- the fixed system sees as rank mod capacity: the hashing trick into a table of the same rows.
Steps interleave (benchmarks/paired.py: the two run back to back every step, in alternating
order), and the ratio is the median of the per-step ratios dynamic / fixed.

Parity (what is compared): both systems train the same dense model from the same seed on the
same dense features, labels and id frequencies, so their losses start together and must stay
close; exact equality is not expected (their rows differ: hash collisions vs a slot per id).
It prints the mean loss of each over the last 10 steps, and the dynamic tables' admissions,
evictions and occupancy, which show the maps did the work being timed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (
    command_line,
    compose_config,
    git_state,
    hardware,
    markdown_table,
    median,
)
from benchmarks.paired import paired_ratio, step_order
from hybridrec.data import build_source
from hybridrec.distributed import DistEnv
from hybridrec.train.trainer import Trainer
from hybridrec.types import Batch


def make_cfg(args: argparse.Namespace, dynamic: bool):  # noqa: ANN201
    caps = [int(c) for c in args.capacities.split(",")]
    overrides = [
        "model=dlrm_tiny",
        f"model.num_embeddings_per_feature=[{','.join(map(str, caps))}]",
        f"train.batch_size={args.batch_size}",
        f"optim.sparse.name={args.optimizer}",
        f"train.compile={args.compile}",
        "train.check_ids=false",
        "device=cpu",
    ]
    if dynamic:
        overrides += [f"+model.dynamic.cat_{t}.evict={args.evict}" for t in range(len(caps))]
    return compose_config(overrides), caps


def make_batches(args: argparse.Namespace, cfg, caps: list[int]):  # noqa: ANN001, ANN201
    """(batches for the fixed system, the same batches with raw ids for the dynamic one)."""
    source = build_source(cfg)
    rng = np.random.default_rng(0)
    fixed, raw = [], []
    universes = [args.universe * c for c in caps]
    raw_of = [rng.choice(1 << 40, size=u, replace=False) for u in universes]  # rank -> raw id
    for s in range(args.batches):
        b = source.batch(s, args.batch_size)
        ranks = []
        for u in universes:
            p = 1.0 / np.arange(1, u + 1) ** args.zipf
            ranks.append(rng.choice(u, size=args.batch_size, p=p / p.sum()))
        f_ids = np.stack([r % c for r, c in zip(ranks, caps, strict=True)], 1)
        r_ids = np.stack([m[r] for r, m in zip(ranks, raw_of, strict=True)], 1)
        fixed.append(Batch(b.dense, torch.from_numpy(f_ids).long(), b.labels))
        raw.append(Batch(b.dense, torch.from_numpy(r_ids).long(), b.labels))
    return fixed, raw


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacities", default="65536,16384,4096,1024", help="rows per table")
    p.add_argument("--universe", type=int, default=4, help="distinct ids per table / capacity")
    p.add_argument("--zipf", type=float, default=1.05, help="id popularity ~ 1 / rank^zipf")
    p.add_argument("--evict", default="lfu", help="the dynamic tables' eviction: lfu | lru")
    p.add_argument("--optimizer", default="rowwise_adagrad")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batches", type=int, default=16, help="distinct batches, cycled")
    p.add_argument("--compile", default="none", help="train.compile: none | dense")
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    fixed_cfg, caps = make_cfg(args, dynamic=False)
    dynamic_cfg, _ = make_cfg(args, dynamic=True)
    fixed_batches, raw_batches = make_batches(args, fixed_cfg, caps)
    systems = {
        "fixed": (Trainer(fixed_cfg, DistEnv(device=torch.device("cpu"))), fixed_batches),
        "dynamic": (Trainer(dynamic_cfg, DistEnv(device=torch.device("cpu"))), raw_batches),
    }
    times: dict[str, list[float]] = {k: [] for k in systems}
    losses: dict[str, list[float]] = {k: [] for k in systems}
    for i in range(args.warmup + args.steps):
        for name in step_order(list(systems), i):
            trainer, batches = systems[name]
            if i == args.warmup:
                trainer.timer.report(1)  # the phases of the timed steps only
            t0 = time.perf_counter()
            loss = trainer.train_step(batches[i % len(batches)])
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times[name].append(dt)
            losses[name].append(float(loss))
    ratio, q1, q3 = paired_ratio(times["dynamic"], times["fixed"])
    phases = {k: systems[k][0].timer.report(args.steps) for k in systems}
    names = sorted(set(phases["fixed"]) | set(phases["dynamic"]))
    phase_rows = [
        [n, f"{phases['fixed'].get(n, 0.0):.2f}", f"{phases['dynamic'].get(n, 0.0):.2f}"]
        for n in names
    ]
    stats = systems["dynamic"][0].embeddings[0].dynamic_stats()
    tail = {k: sum(v[-10:]) / len(v[-10:]) for k, v in losses.items()}
    ms = {k: 1e3 * median(v) for k, v in times.items()}
    rows = [
        ["fixed (hashing into capacity rows)", f"{ms['fixed']:.2f}", f"{tail['fixed']:.4f}"],
        [
            "dynamic (raw ids, admit always, evict " + args.evict + ")",
            f"{ms['dynamic']:.2f}",
            f"{tail['dynamic']:.4f}",
        ],
    ]
    table_rows = [
        [t, caps[int(t.split("_")[1])], s.used, s.admitted_total, s.evicted_total]
        for t, s in sorted(stats.items())
    ]
    lines = [
        f"dynamic / fixed step time: {ratio:.3f}x (median of {args.steps} paired steps; "
        f"quartiles {q1:.3f}..{q3:.3f}); goal <= 1.3x",
        f"fixed {ms['fixed']:.2f} ms, dynamic {ms['dynamic']:.2f} ms per step (medians)",
        f"parity: mean loss over the last 10 steps: fixed {tail['fixed']:.4f}, dynamic "
        f"{tail['dynamic']:.4f}; first step: {losses['fixed'][0]:.5f} vs "
        f"{losses['dynamic'][0]:.5f}",
    ]
    for t, cap, used, adm, ev in table_rows:
        lines.append(f"  {t}: {cap} slots, {used} used, {adm} admitted, {ev} evicted")
    lines.append(
        "phases, ms per step (fixed / dynamic): "
        + ", ".join(f"{n} {a}/{b}" for n, a, b in phase_rows)
    )
    machine, commit = hardware(), git_state()
    print("\n".join(lines))
    print(f"machine: {machine}\ncommit: {commit}\ncommand: {command_line()}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            "# Dynamic vs fixed tables: one training step on the CPU\n\n"
            f"Command: `{command_line()}`\n\n- Machine: {machine}\n- Commit: {commit}\n"
            f"- Tables of {args.capacities} rows, width 16, dlrm_tiny MLPs, "
            f"{args.optimizer}, global batch {args.batch_size}, ids Zipf({args.zipf}) over "
            f"{args.universe}x each capacity; {args.batches} batches cycled; median of "
            f"{args.steps} paired, interleaved steps after {args.warmup} warmup; "
            f"train.compile={args.compile}.\n\n"
            f"**dynamic / fixed = {ratio:.3f}x** (quartiles {q1:.3f}..{q3:.3f}; goal <= 1.3x)\n\n"
            + markdown_table(["system", "ms/step", "mean loss, last 10 steps"], rows)
            + "\n\nThe dynamic tables after the run (admissions and evictions: the maps' "
            "work is in the timed steps):\n\n"
            + markdown_table(["table", "slots", "used", "admitted", "evicted"], table_rows)
            + "\n\nWhere the time goes: the trainer's phase timer, mean ms per timed step "
            "(phases nest: `step` holds the others; `dynamic_map` is the maps' work: "
            "admission, eviction, fresh rows, ids to rows):\n\n"
            + markdown_table(["phase", "fixed", "dynamic"], phase_rows)
            + "\n\nParity: the same dense model and seed, the same dense features, labels "
            "and id frequencies; the rows differ (hash collisions vs one slot per admitted "
            "id), so the losses are compared for closeness, not equality.\n"
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
