"""Where a hybridrec training step spends its device time, kernel by kernel.

    python -m benchmarks.profile_step --device cuda --model dlrm_kaggle --batch-size 65536 \
        --optimizers sgd,rowwise_adagrad --kernels triton
    python -m benchmarks.profile_step --device cuda --override sharding=host \
        --override sharding.cache_fraction=0.05 --batches 8     # host rows behind a cache

For each optimizer: the step of benchmarks/step.py (`sharding=none`, same model, same
pre-generated batches on the device), `--warmup` untimed steps, then `--steps` steps under
torch.profiler; prints the ops and kernels by self device time (the top `--rows`) and the
step's wall time. `--override key=value` (repeatable) changes the config, e.g. sharding=host;
then each step prefetches the next batch's rows as the trainer does (the batches cycle, so a
cache sees rows again: use more `--batches` than for the on-device step). `--out` writes the
tables as markdown. A companion to step.py: that one says how fast, this one says where the
time goes below the trainer's phases.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import command_line, hardware, reset_device, sync
from benchmarks.step import device_defaults, make_cfg
from hybridrec.data import build_source
from hybridrec.distributed import DistEnv, init_distributed
from hybridrec.train.trainer import Trainer


def profile_one(args: argparse.Namespace, sparse: str, env: DistEnv) -> str:
    device = env.device
    reset_device(device)
    cfg = make_cfg(args, sparse, args.kernels, args.override)
    source = build_source(cfg)
    batches = [source.batch(s, args.batch_size).to(device) for s in range(args.batches)]
    trainer = Trainer(cfg, env)
    # host rows: the pipeline prefetches the next batch's, as training does
    pipe = trainer.pipeline(batches[i % len(batches)] for i in itertools.count())

    def step(i: int) -> None:
        trainer.train_step(pipe.next(), pipe)

    for i in range(args.warmup):
        step(i)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for i in range(args.warmup, args.warmup + args.steps):
            step(i)
        sync(device)
    ms = 1e3 * (time.perf_counter() - t0) / args.steps
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=70)
    title = f"## {sparse}, {args.kernels} kernels: {ms:.2f} ms/step under the profiler"
    return f"{title}\n\n```\n{table}\n```\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--model", default=None, help="default: dlrm_kaggle on CUDA, dlrm_tiny on CPU")
    p.add_argument("--batch-size", type=int, default=None, help="default 65536 CUDA, 4096 CPU")
    p.add_argument("--optimizers", default="sgd")
    p.add_argument("--kernels", default="auto", help="train.kernels: auto | torch | triton")
    p.add_argument("--compile", default="auto", help="train.compile: auto | dense | none")
    p.add_argument("--check-ids", default="false", help="train.check_ids")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batches", type=int, default=2, help="distinct batches, cycled")
    p.add_argument("--rows", type=int, default=30, help="ops listed per optimizer")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        help="a Hydra override for the hybridrec config (repeatable), e.g. sharding=host",
    )
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    device = device_defaults(args)
    torch.manual_seed(0)
    sharded = any(o.startswith("sharding=") and o != "sharding=none" for o in args.override)
    # a sharded mode (sharding=host) needs a process group: one rank here
    env = init_distributed(args.device, force_group=True) if sharded else DistEnv(device=device)
    parts = [
        "# Where a hybridrec step's device time goes\n",
        f"Command: `{command_line()}`\n",
        f"- Hardware: {hardware()}\n- Model `{args.model}`, batch {args.batch_size}, "
        f"{args.steps} profiled steps after {args.warmup} warmup, train.compile={args.compile}"
        f", overrides: {' '.join(args.override) or 'none'}.\n",
    ]
    for sparse in args.optimizers.split(","):
        section = profile_one(args, sparse, env)
        print(section, flush=True)
        parts.append(section)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("\n".join(parts))


if __name__ == "__main__":
    main()
