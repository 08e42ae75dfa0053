"""Single-device training step: plain PyTorch vs hybridrec, same model, same data, one process.

    python -m benchmarks.step --device cuda --model dlrm_kaggle --batch-size 65536   # issue 5
    python -m benchmarks.step --device cpu --model dlrm_tiny --batch-size 4096      # smoke

Rows, each timed over the same pre-generated batches already on the device (data loading is
not timed; the batches cycle):
- dense part alone: the MLPs and interaction (compiled per `train.compile`) and the dense
  optimizer on ready pooled embeddings: how fast a step could be if embeddings were free;
- plain PyTorch: one nn.EmbeddingBag(sparse=True) per table, torch.optim SGD / SparseAdam for
  the embeddings, hybridrec's dense part and dense optimizer (benchmarks/baseline.py);
- hybridrec (`sharding=none`): fused tables, the sparse optimizer applied inside the
  backward (sgd, rowwise_adagrad, adam), the dense part compiled per `train.compile`.
bf16 autocast for the MLPs on CUDA in every row. Prints samples/s, the ratio to the plain SGD
row and peak device memory; `--out` writes a markdown report with command and hardware.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.baseline import PlainDLRM, plain_sparse_optimizer
from benchmarks.common import (
    command_line,
    compose_config,
    hardware,
    markdown_table,
    median,
    peak_memory,
    reset_device,
    sync,
    time_steps,
)
from hybridrec.builder import compile_model
from hybridrec.config import Config
from hybridrec.data import build_source
from hybridrec.distributed import DistEnv, resolve_device
from hybridrec.model import DenseArch, bce_loss
from hybridrec.optim import build_dense_optimizer
from hybridrec.train.trainer import Trainer
from hybridrec.types import Batch

SPARSE_LR = {"sgd": 0.05, "rowwise_adagrad": 0.05, "adam": 0.001, "adagrad": 0.05}


def make_cfg(
    args: argparse.Namespace, sparse: str, kernels: str = "auto", extra: Sequence[str] = ()
) -> Config:
    """The benchmark's validated config; `extra` Hydra overrides come last (they win)."""
    overrides = [
        f"model={args.model}",
        f"train.batch_size={args.batch_size}",
        f"optim.sparse.name={sparse}",
        f"optim.sparse.lr={SPARSE_LR[sparse]}",
        f"train.compile={args.compile}",
        f"train.check_ids={args.check_ids}",
        f"train.kernels={kernels}",
        f"device={args.device}",
        *extra,
    ]
    return compose_config(overrides)


def device_defaults(args: argparse.Namespace) -> torch.device:
    """Resolve --device; an unset --model / --batch-size gets the device's default (the
    Kaggle model at 65,536 on CUDA, dlrm_tiny at 4,096 on the CPU)."""
    device = resolve_device(args.device)
    args.device = device.type
    args.model = args.model or ("dlrm_kaggle" if device.type == "cuda" else "dlrm_tiny")
    args.batch_size = args.batch_size or (65536 if device.type == "cuda" else 4096)
    return device


def run_plain(cfg: Config, batches: list[Batch], device: torch.device, args) -> dict:  # noqa: ANN001
    reset_device(device)
    model = PlainDLRM(cfg, device).to(device)  # tables initialised on the device: fast
    dense_opt = build_dense_optimizer(model.dense.parameters(), cfg.optim.dense, device)
    sparse_opt = plain_sparse_optimizer(list(model.bags.parameters()), cfg)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(i: int) -> None:
        b = batches[i % len(batches)]
        with autocast:
            logits = model(b.dense, b.ids).float()
        loss = bce_loss(logits, b.labels)
        dense_opt.zero_grad(set_to_none=True)
        sparse_opt.zero_grad(set_to_none=True)
        loss.backward()
        dense_opt.step()
        sparse_opt.step()
        sync(device)

    times = time_steps(step, args.steps, args.warmup, before=lambda: sync(device))
    out = {"ms": 1e3 * median(times), "peak": peak_memory(device, 1e9)}
    return out


def run_dense_only(cfg: Config, batches: list[Batch], device: torch.device, args) -> dict:  # noqa: ANN001
    """The dense part alone (compiled as train.compile says), fed ready pooled embeddings
    that take a gradient: the floor for any step that runs it after the lookup."""
    reset_device(device)
    torch.manual_seed(cfg.seed)
    dense = DenseArch(cfg.model).to(device)
    compile_model(dense, cfg.train.compile, device)
    opt = build_dense_optimizer(dense.parameters(), cfg.optim.dense, device)
    tables = len(cfg.model.num_embeddings_per_feature)
    shape = (args.batch_size, tables, cfg.model.embedding_dim)
    cuda = device.type == "cuda"
    # what the lookup hands over: bf16 under autocast for DLRM's dot interaction (see
    # hybridrec.sparse.collection), fp32 otherwise
    dtype = torch.bfloat16 if cuda and cfg.model.arch == "dlrm" else torch.float32
    pooled = [torch.randn(shape, device=device, dtype=dtype).requires_grad_() for _ in batches]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def step(i: int) -> None:
        b, p = batches[i % len(batches)], pooled[i % len(batches)]
        with autocast:
            logits = dense(b.dense, p).float()
        loss = bce_loss(logits, b.labels)
        opt.zero_grad(set_to_none=True)
        p.grad = None
        loss.backward()
        opt.step()
        sync(device)

    times = time_steps(step, args.steps, args.warmup, before=lambda: sync(device))
    return {"ms": 1e3 * median(times), "peak": peak_memory(device, 1e9)}


def run_hybridrec(
    cfg: Config,
    batches: list[Batch],
    device: torch.device,
    args,  # noqa: ANN001
    per_table: bool = False,
    fp32_handoff: bool = False,
) -> dict:
    reset_device(device)
    trainer = Trainer(cfg, DistEnv(device=device))
    if per_table:  # the lookup's older layout: per-table outputs stacked (and cat'ed back)
        trainer.embeddings[0].exchange = trainer.embeddings[0].all_to_all
    if fp32_handoff:  # pooled embeddings in fp32 even under autocast (the dense part casts)
        trainer.embeddings[0].autocast_output = False

    def step(i: int) -> None:
        if i == args.warmup:
            trainer.timer.report(1)  # phases of the timed steps only
        trainer.train_step(batches[i % len(batches)])
        sync(device)

    times = time_steps(step, args.steps, args.warmup, before=lambda: sync(device))
    out = {"ms": 1e3 * median(times), "peak": peak_memory(device, 1e9)}
    out["phases"] = breakdown(trainer.timer.report(args.steps), out["ms"])
    return out


PHASES = ("lookup", "dense fwd", "dense bwd", "sparse update", "dense optimizer", "other")


def breakdown(timed: dict[str, float], step_ms: float) -> dict[str, float]:
    """Where a step's time goes (ms), from the trainer's phase timer (CUDA events on the
    GPU): the forward less the lookup is the dense forward, the backward less the sparse
    update the dense backward; `other` is the rest of the step (loss, launches, gaps)."""
    get = timed.get
    out = {
        "lookup": get("lookup", 0.0),
        "dense fwd": get("forward", 0.0) - get("lookup", 0.0),
        "dense bwd": get("backward", 0.0) - get("sparse_update", 0.0),
        "sparse update": get("sparse_update", 0.0),
        "dense optimizer": get("dense_optimizer", 0.0),
    }
    out["other"] = step_ms - sum(out.values())
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument(
        "--model",
        default=None,
        help="model config (default: dlrm_kaggle on CUDA, dlrm_tiny on CPU)",
    )
    p.add_argument("--batch-size", type=int, default=None, help="default 65536 CUDA, 4096 CPU")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batches", type=int, default=4, help="distinct batches, cycled")
    p.add_argument("--optimizers", default="sgd,rowwise_adagrad,adam")
    p.add_argument("--compile", default="auto", help="train.compile: auto | dense | none")
    p.add_argument("--check-ids", default="false", help="train.check_ids for hybridrec rows")
    p.add_argument("--plain-adam", action="store_true", help="also time plain SparseAdam")
    p.add_argument(
        "--graphs",
        action="store_true",
        help="also time SGD with train.compile=graphs (the compiled dense part replayed as "
        "CUDA graphs)",
    )
    p.add_argument(
        "--per-table-layout",
        action="store_true",
        help="also time SGD with the lookup's per-table output layout (stack + cat copies) "
        "instead of the sample-major one",
    )
    p.add_argument(
        "--fp32-handoff",
        action="store_true",
        help="also time SGD with the pooled embeddings handed to the dense part in fp32 (cast "
        "there) instead of in the autocast dtype (the same bits)",
    )
    p.add_argument(
        "--kernels",
        default="auto",
        help="train.kernels for the hybridrec rows, comma-separated: auto,torch,triton "
        "(e.g. triton,torch times both the Triton kernels and the torch ops)",
    )
    p.add_argument(
        "--floor-sps",
        type=float,
        default=None,
        help="the card's samples/s floor for the 'of floor' column (about 19e6 on an "
        "H100; default: 19e6 on CUDA, none on CPU)",
    )
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    device = device_defaults(args)
    if args.floor_sps is None and device.type == "cuda":
        args.floor_sps = 19e6
    torch.manual_seed(0)

    base = make_cfg(args, "sgd")
    source = build_source(base)
    batches = [source.batch(s, args.batch_size).to(device) for s in range(args.batches)]
    rows: list[list[str]] = []
    phases: list[list[str]] = []
    plain = run_plain(base, batches, device, args)
    ref = plain["ms"]

    def add(name: str, res: dict) -> None:
        sps = args.batch_size / (res["ms"] / 1e3)
        floor = f"{sps / args.floor_sps:.2f}" if args.floor_sps else "-"
        rows.append(
            [name, f"{res['ms']:.2f}", f"{sps:,.0f}", f"{ref / res['ms']:.2f}", floor]
            + [res["peak"]]
        )
        print(
            f"{name:40s} {res['ms']:8.2f} ms  {sps:14,.0f} samples/s  "
            f"x{ref / res['ms']:.2f}  of floor {floor}  peak {res['peak']} GB",
            flush=True,
        )
        if "phases" in res:
            phases.append([name, *(f"{res['phases'][k]:.2f}" for k in PHASES)])
            print("    " + ", ".join(f"{k} {res['phases'][k]:.2f}" for k in PHASES) + " ms")
        if args.out:  # after every row: a run cut short still leaves its report
            write_report(args, rows, phases)

    add("plain PyTorch, EmbeddingBag + SGD", plain)
    add("dense part alone (no embeddings)", run_dense_only(base, batches, device, args))
    if args.plain_adam:
        add(
            "plain PyTorch, EmbeddingBag + SparseAdam",
            run_plain(make_cfg(args, "adam"), batches, device, args),
        )
    # the target rows (first kernel choice, every optimizer) first, then the variants of the
    # SGD row, then the other kernel choices: a run cut short keeps what matters most
    kernel_modes = args.kernels.split(",")
    for i, kernels in enumerate(kernel_modes):
        for name in args.optimizers.split(","):
            label = f"hybridrec, {name}" + (f", {kernels} kernels" if kernels != "auto" else "")
            cfg = make_cfg(args, name, kernels)
            add(label, run_hybridrec(cfg, batches, device, args))
        if i > 0:
            continue
        if args.per_table_layout:
            cfg = make_cfg(args, "sgd", kernels)
            add("hybridrec, sgd, per-table layout", run_hybridrec(cfg, batches, device, args, True))
        if args.fp32_handoff:
            cfg = make_cfg(args, "sgd", kernels)
            res = run_hybridrec(cfg, batches, device, args, fp32_handoff=True)
            add("hybridrec, sgd, fp32 pooled hand-off", res)
        if args.graphs:
            cfg = make_cfg(args, "sgd", kernels)
            cfg.train.compile = "graphs"
            add("hybridrec, sgd, CUDA graphs", run_hybridrec(cfg, batches, device, args))
    if args.out:
        print(f"wrote {args.out}")


def write_report(args: argparse.Namespace, rows: list[list[str]], phases: list[list[str]]) -> None:
    headers = ["run", "ms/step", "samples/s", "vs plain SGD", "of floor", "peak GB"]
    table = markdown_table(headers, rows)
    where = markdown_table(["run (ms/step)", *PHASES], phases) if phases else ""
    floor = f"{args.floor_sps:,.0f} samples/s (`--floor-sps`)" if args.floor_sps else "not given"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        f"# Single-device step: plain PyTorch vs hybridrec\n\nCommand: `{command_line()}`\n\n"
        f"- Hardware: {hardware()}\n- Model `{args.model}`, global batch {args.batch_size}, "
        f"{args.batches} distinct synthetic batches on the device, median of {args.steps} "
        f"steps after {args.warmup} warmup; train.compile={args.compile}, "
        f"check_ids={args.check_ids}; floor: {floor}.\n\n{table}\n"
        f"\n## Where the time goes\n\nThe trainer's phase timer (CUDA events on a GPU), mean "
        f"ms per timed step; `other` is the rest of the median step.\n\n{where}\n"
    )


if __name__ == "__main__":
    main()
