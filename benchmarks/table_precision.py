"""Accuracy effect of low-precision embedding tables on the synthetic teacher task.

    python -m benchmarks.table_precision --out benchmarks/results/table_precision.md

Trains the same model (same seed, data, steps) with fp32, bf16 and fp16 table weights
(optimizer state and math fp32, each updated row rounded once) and reports the final eval
AUC and log loss over the same held-out batches, next to the fp32 run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import command_line, compose_config, hardware, markdown_table
from hybridrec.distributed import init_distributed
from hybridrec.train.trainer import Trainer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dlrm_tiny")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--optimizers", default="rowwise_adagrad,sgd")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--override", action="append", default=[], help="extra key=value")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for opt in args.optimizers.split(","):
        lr = {"sgd": 1.0, "rowwise_adagrad": 0.05, "adam": 0.01}[opt]
        base = None
        for dtype in ("fp32", "bf16", "fp16"):
            overrides = [
                f"model={args.model}",
                f"model.table_dtype={dtype}",
                f"train.steps={args.steps}",
                f"train.batch_size={args.batch_size}",
                f"optim.sparse.name={opt}",
                f"optim.sparse.lr={lr}",
                "eval.every=0",
                "train.log_every=1000000",
                "device=cpu",
                *args.override,
            ]
            cfg = compose_config(overrides)
            ev = Trainer(cfg, init_distributed("cpu")).fit()["eval"]
            base = base or ev
            rows.append(
                [
                    opt,
                    dtype,
                    f"{ev['auc']:.4f}",
                    f"{ev['auc'] - base['auc']:+.4f}",
                    f"{ev['logloss']:.4f}",
                    f"{ev['logloss'] - base['logloss']:+.4f}",
                ]
            )
            print(rows[-1], flush=True)
    table = markdown_table(
        ["sparse optimizer", "tables", "eval AUC", "vs fp32", "log loss", "vs fp32"], rows
    )
    print(table)
    if args.out:
        args.out.write_text(
            "# Embedding table precision on the synthetic teacher task\n\n"
            f"Command: `{command_line()}`\n\n- Hardware: {hardware()}\n"
            f"- Model `{args.model}`, {args.steps} steps of global batch {args.batch_size}, "
            "seed 0; eval over the same 8 held-out batches of 2048. Optimizer state and math "
            "fp32; each updated row is rounded once to the table dtype (round to nearest).\n\n"
            f"{table}\n"
        )


if __name__ == "__main__":
    main()
