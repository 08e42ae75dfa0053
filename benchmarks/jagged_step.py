"""Jagged (list) features against fixed bags of the same average length: one training step.

Two models alike but for their bags: `fixed`, every table looked up K times per sample, and
`jagged`, every table a list feature of 0..2K ids per sample (uniform, so K on average, padded
with -1; model.mean_ids=K for the planner). Same tables, widths, batch and optimizer; the
synthetic data draws the ids the same way. For each world size (1 process; W gloo ranks, one
thread each, via tests/distributed/harness.py) and sharding mode, both are timed with
Trainer.train_step (forward, exchanges, backward with the sparse update, dense step), in
`--rounds` alternating rounds so that load on the host hits both alike; the table shows the
median step time and jagged / fixed. The issue's target: jagged at most 10% slower.

    python -m benchmarks.jagged_step --out benchmarks/results/jagged_step_cpu.md
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

from benchmarks.common import command_line, compose_config, hardware, markdown_table, median
from benchmarks.sharding_gloo import measure
from hybridrec.config import Config
from hybridrec.distributed import DistEnv
from tests.distributed.harness import spawn

ROWS = "[1000,3000,10000,30000,100000,100000,300000,300000]"


def make_cfg(args: argparse.Namespace, kind: str, mode: str, world: int) -> Config:
    k, n = args.ids, 8
    bags = (
        [f"model.hotness={k}"]
        if kind == "fixed"
        else [
            f"model.hotness={2 * k}",
            "model.jagged=true",
            f"model.mean_ids=[{','.join([str(float(k))] * n)}]",
        ]
    )
    return compose_config(
        [
            "model=dlrm_tiny",
            "model.embedding_dim=32",
            f"model.num_embeddings_per_feature={ROWS}",
            "model.bottom_mlp=[64,32]",
            "model.top_mlp=[128,64,1]",
            *bags,
            f"sharding={mode}",
            "device=cpu",
            f"train.batch_size={args.batch_size}",
            f"eval.batch_size={args.batch_size}",
            f"optim.sparse.name={args.optimizer}",
            "logger=none",
        ],
        world_size=world,
    )


def run_rank(env: DistEnv, jobs: list[tuple[str, Config]], steps: int, warmup: int) -> dict:
    out = {}
    for name, cfg in jobs:
        out[name] = measure(env, cfg, steps, warmup)["times"]
        gc.collect()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ids", type=int, default=4, help="K: ids per bag (jagged: 0..2K)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--optimizer", default="rowwise_adagrad")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--modes", nargs="+", default=["table_wise", "row_wise"])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rows = []
    for world in args.worlds:
        modes = ["none"] if world == 1 else args.modes
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for mode in modes:
                for kind in ("fixed", "jagged"):
                    cfg = make_cfg(args, kind, mode, world)
                    if world == 1:
                        t = measure(DistEnv(), cfg, args.steps, args.warmup)["times"]
                    else:
                        per_rank = spawn(
                            world, run_rank, [(kind, cfg)], args.steps, args.warmup, timeout=900
                        )
                        t = [max(ts) for ts in zip(*(r[kind] for r in per_rank), strict=True)]
                    times.setdefault((mode, kind), []).extend(t)
        for mode in modes:
            fixed, jagged = median(times[(mode, "fixed")]), median(times[(mode, "jagged")])
            rows.append(
                [
                    str(world),
                    mode,
                    f"{fixed * 1e3:.1f}",
                    f"{jagged * 1e3:.1f}",
                    f"{jagged / fixed:.2f}",
                ]
            )
            print(
                f"W={world} {mode}: fixed {fixed * 1e3:.1f} ms, jagged {jagged * 1e3:.1f} ms, "
                f"jagged/fixed {jagged / fixed:.2f}",
                flush=True,
            )
    table = markdown_table(
        [
            "ranks",
            "sharding",
            "fixed K ids (ms/step)",
            "jagged 0..2K ids (ms/step)",
            "jagged / fixed",
        ],
        rows,
    )
    print(table)
    if args.out:
        args.out.write_text(
            "# Jagged features vs fixed bags of the same average length\n\n"
            f"{__doc__.split(chr(10) + chr(10))[1]}\n\n"
            f"K = {args.ids}, batch {args.batch_size}, optimizer {args.optimizer}, "
            f"{args.steps} steps x {args.rounds} rounds per row, tables {ROWS} x 32.\n\n"
            f"Command: `{command_line()}`\n\nHardware: {hardware()}\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
