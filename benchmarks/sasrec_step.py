"""hybridrec's SASRec training step against the same model in plain PyTorch, one process on the
CPU, side by side on the same batches (issue 39).

- hybridrec: `Trainer.train_step` on a validated config (model=sasrec, data=sequences on a
  `user item` file, sharding none): the item table is a sequence feature `seq` [L + 1] plus
  the per-position negatives `neg` [L * N], one lookup per step; the sparse Adam updates the
  rows the batch touched inside the backward (optim.sparse.name=adam, eps form sparse_adam);
  the encoder (hybridrec.model.sasrec.SASRec) steps with torch.optim.Adam.
- plain, sparse Adam: what a PyTorch user writes for the same semantics: the item table an
  `nn.Embedding(items + 1, D, padding_idx=0, sparse=True)` (id i in row i + 1, PAD -1 in the
  zero row 0, which gets no gradient: SASRec.pytorch's layout), `torch.optim.SparseAdam` on
  it (lazy: the rows a batch touched, bias corrections by the global step: hybridrec's
  sparse_adam form), the same encoder module (benchmarks.sasrec_baseline.SASRecModel's, its
  weights copied from hybridrec's, run on groups of similar lengths as hybridrec's
  model runs it: hybridrec.model.sequential.encode_grouped) under the same torch.optim.Adam.
- plain, dense Adam: the same with `nn.Embedding(sparse=False)` and one torch.optim.Adam over
  every parameter: what most PyTorch SASRec code runs (SASRec.pytorch's). Adam then moves every
  row that was ever touched, at every step, and adds eps to the bias-corrected sqrt(v): not
  hybridrec's optimizer, so its losses match only at the first step (before any update); the
  parity check holds it to that step and prints its later gap.

All three start from hybridrec's initial rows and encoder weights and read the trainer's own
batches (the same `neg` items), with the same loss: hybridrec.model.next_item.sampled_bce_loss
over every training position (SASRec's BCE, one negative per position by default), divided by
the batch's count of training positions. Dropout draws the same masks on every side: the global
RNG is reseeded before each system's step (outside the timing).

Parity (benchmarks/paired.py): the largest loss gap to hybridrec over the first 10 steps is
printed; above 1e-6 for the sparse-Adam baseline (or at the first step for the dense one) the
run exits 1 and writes no report. Timing: per step the systems run one after the other, in
alternating order; the ratio is the median over steps of (their step / hybridrec's step in the
same step), with quartiles (> 1: hybridrec faster). Each step's CPU time (this process's
time.process_time(): what the step computed, not the time other processes on a shared machine
held the cores) is paired the same way.

    OMP_NUM_THREADS=1 python -m benchmarks.sasrec_step --out benchmarks/results/sasrec_step_cpu.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import (
    command_line,
    compose_config,
    cpu_seconds,
    git_state,
    hardware,
    host_cores,
    load_average,
    markdown_table,
    median,
)
from benchmarks.paired import (
    HEAPS,
    PARITY_STEPS,
    PARITY_TOL,
    heap_option,
    loss_gaps,
    paired_ratio,
    parity_failures,
    step_order,
    use_heap,
)
from benchmarks.sasrec_baseline import DEFAULT_DATA, SASRecModel
from hybridrec.config import Config
from hybridrec.distributed import DistEnv
from hybridrec.model.next_item import sampled_bce_loss
from hybridrec.model.sasrec import POSITIONS
from hybridrec.model.sequential import encode_grouped
from hybridrec.optim import build_dense_optimizer
from hybridrec.sparse.api import embedding_modules
from hybridrec.train.trainer import Trainer
from hybridrec.types import Batch

SYSTEMS = ("hybridrec", "plain_sparse", "plain_dense")
NAMES = {
    "hybridrec": "hybridrec",
    "plain_sparse": "plain, Embedding(sparse) + SparseAdam",
    "plain_dense": "plain, Embedding + Adam",
}
# the baseline held to parity over PARITY_STEPS steps, and the one held to it at step 0 only
FULL_PARITY, FIRST_STEP_PARITY = "plain_sparse", "plain_dense"


def make_cfg(args: argparse.Namespace) -> Config:
    """The trainer's config: SASRec on the data, Adam on both sides, one process."""
    return compose_config(
        [
            "data=sequences",
            f"data.path={args.data}",
            f"data.sequence.max_len={args.max_len}",
            "model=sasrec",
            f"model.embedding_dim={args.dim}",
            f"model.args.blocks={args.blocks}",
            f"model.args.heads={args.heads}",
            f"model.args.dropout={args.dropout}",
            f"+model.args.positions={args.positions}",
            f"train.batch_size={args.batch_size}",
            f"train.next_item.negatives={args.negatives}",
            "train.compile=none",
            "optim.sparse.name=adam",
            f"optim.sparse.lr={args.lr}",
            "optim.dense.name=adam",
            f"optim.dense.lr={args.lr}",
            f"seed={args.seed}",
            "logger=none",
            "device=cpu",
        ]
    )


class PlainSASRec(SASRecModel):
    """benchmarks.sasrec_baseline's model with SASRec.pytorch's item layout: item i in row
    i + 1 of an nn.Embedding with padding_idx 0, so PAD (-1) reads the zero row and no row
    gets a gradient from it (a sparse gradient leaves it out)."""

    def __init__(self, num_items: int, args: argparse.Namespace, sparse: bool) -> None:
        super().__init__(num_items, args)
        self.items = nn.Embedding(num_items + 1, args.dim, padding_idx=0, sparse=sparse)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.items(ids + 1)


def _hybridrec_parts(trainer: Trainer) -> tuple[nn.Module, torch.Tensor]:
    """(hybridrec's encoder module, its item table's rows [items, D])."""
    model = trainer.model
    model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    shards = [(s, w) for m in embedding_modules(model) for s, w, _ in m.shard_views()]
    [(spec, weight)] = [(s, w) for s, w in shards if s.table == "item"]
    assert spec.row_start == 0 and spec.col_start == 0, "one process holds the whole table"
    return model.encoder, weight


def _groups(trainer: Trainer) -> int:
    """hybridrec's encoder groups (NextItemModel.groups): the plain side runs its encoder the
    same way (encode_grouped: the same values, PAD columns skipped, and the same dropout draws
    in the same order; sasrec_baseline.py's SASRecModel.grouped does the same)."""
    model = trainer.model
    model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return model.groups


def plain_step(trainer: Trainer, cfg: Config, args: argparse.Namespace, sparse: bool):  # noqa: ANN201
    """Plain PyTorch's step on the trainer's batches, from hybridrec's initial weights."""
    encoder, rows = _hybridrec_parts(trainer)
    model = PlainSASRec(rows.shape[0], args, sparse)
    model.encoder.load_state_dict(encoder.state_dict())
    with torch.no_grad():
        model.items.weight[1:].copy_(rows)
    device = torch.device("cpu")
    if sparse:
        s = cfg.optim.sparse
        opts = [
            torch.optim.SparseAdam(
                list(model.items.parameters()), lr=s.lr, betas=(s.beta1, s.beta2), eps=s.eps
            ),
            build_dense_optimizer(model.encoder.parameters(), cfg.optim.dense, device),
        ]
    else:
        opts = [build_dense_optimizer(model.parameters(), cfg.optim.dense, device)]
    length, n = args.max_len, args.negatives
    groups = _groups(trainer)

    def step(b: Batch) -> torch.Tensor:
        model.train()
        seq, neg = b.ids[:, : length + 1], b.ids[:, length + 1 :]
        rows = model.rows(seq)  # one lookup for inputs and targets, as hybridrec's
        mask = seq >= 0
        hidden = encode_grouped(model.encoder, rows[:, :-1], mask[:, :-1], groups)
        train = mask[:, :-1] & mask[:, 1:]
        negatives = model.rows(neg).view(seq.shape[0], length, n, -1)
        denominator = float(train.sum())
        loss = sampled_bce_loss(hidden, rows[:, 1:], negatives, train, denominator)
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts:
            o.step()
        return loss.detach()

    return step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="hybridrec's SASRec training step vs the same model in plain PyTorch "
        "(one process, CPU), interleaved on the same batches",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a `user item` file")
    p.add_argument("--max-len", type=int, default=50)
    p.add_argument("--dim", type=int, default=50)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.5, help="the paper's on Amazon Games")
    p.add_argument("--positions", default="from_end", choices=POSITIONS)
    p.add_argument("--negatives", type=int, default=1, help="BCE negatives per position")
    p.add_argument("--lr", type=float, default=0.001, help="Adam's, both optimizers")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=30, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    heap_option(p)
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    p.set_defaults(encoder="sasrec")  # SASRecModel's block stack: this benchmark's model
    args = p.parse_args(argv)
    if not args.data.is_file():
        p.error(f"--data {args.data}: no such file (a `user item` file, e.g. amazon_games.txt)")
    if args.warmup + args.steps < PARITY_STEPS:
        p.error(f"--warmup + --steps must be at least {PARITY_STEPS}: the parity check's steps")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def run(args: argparse.Namespace) -> tuple[dict, dict, dict, Trainer]:
    """Per system: its step times and CPU times (timed steps) and losses (every step)."""
    cfg = make_cfg(args)
    trainer = Trainer(cfg, DistEnv(device=torch.device("cpu")))
    batches = [trainer.train_batch(s) for s in range(args.warmup + args.steps)]
    systems = {
        "hybridrec": trainer.train_step,
        "plain_sparse": plain_step(trainer, cfg, args, sparse=True),
        "plain_dense": plain_step(trainer, cfg, args, sparse=False),
    }
    times: dict[str, list[float]] = {k: [] for k in systems}
    cpu: dict[str, list[float]] = {k: [] for k in systems}
    losses: dict[str, list[float]] = {k: [] for k in systems}
    for i, b in enumerate(batches):
        for name in step_order(list(systems), i):
            torch.manual_seed(args.seed * 100_003 + i)  # the same dropout masks everywhere
            c0, t0 = time.process_time(), time.perf_counter()
            loss = systems[name](b)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            losses[name].append(float(loss))
    return times, cpu, losses, trainer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    use_heap(args.heap)
    load_before = load_average()
    busy0, own0, t0 = *cpu_seconds(), time.monotonic()
    print(f"# {hardware()}; load average {load_before}", flush=True)
    times, cpu, losses, trainer = run(args)
    load_after = load_average()
    busy1, own1 = cpu_seconds()
    busy, own, wall = busy1 - busy0, own1 - own0, time.monotonic() - t0
    first = loss_gaps([losses], "hybridrec", PARITY_STEPS)
    whole = loss_gaps([losses], "hybridrec", None)
    at_start = loss_gaps([losses], "hybridrec", 1)
    failures = parity_failures("one process", {FULL_PARITY: first[FULL_PARITY]}, NAMES, "hybridrec")
    failures += [
        line.replace(f"within the first {PARITY_STEPS} steps", "at the first step")
        for line in parity_failures(
            "one process", {FIRST_STEP_PARITY: at_start[FIRST_STEP_PARITY]}, NAMES, "hybridrec"
        )
    ]
    rows = []
    for k in SYSTEMS:
        cells = [NAMES[k]]
        for measure in (times, cpu):
            cells.append(f"{1e3 * median(measure[k]):.2f}")
            if k == "hybridrec":
                cells.append("1.00")
            else:
                mid, q1, q3 = paired_ratio(measure[k], measure["hybridrec"])
                cells.append(f"{mid:.2f} ({q1:.2f}-{q3:.2f})")
        gap = "-" if k == "hybridrec" else f"{first[k][0]:.0e} / {whole[k][0]:.0e}"
        rows.append([*cells, f"{losses[k][-1]:.6f}", gap])
    headers = ["system", "ms/step", "ms / hybridrec's, paired (quartiles)", "CPU ms/step"]
    headers += ["CPU ms / hybridrec's, paired (quartiles)", "last loss"]
    headers += [f"max loss gap to hybridrec, first {PARITY_STEPS} / all steps"]
    table = markdown_table(headers, rows)
    print(table)
    if failures:
        for line in failures:
            print(f"sasrec_step: {line}", file=sys.stderr)
        print("sasrec_step: no report written", file=sys.stderr)
        return 1
    if args.out is not None:
        items = _hybridrec_parts(trainer)[1].shape[0]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(
            "# hybridrec's SASRec step vs plain PyTorch, one process on the CPU\n\n"
            f"Command: `{command_line()}`\n\n"
            f"- Machine: {hardware()}; one torch thread\n"
            f"- CPU time on the machine during the run: {busy:.0f} CPU-s in {wall:.0f} s on "
            f"{host_cores()} cores, {own:.0f} of them this benchmark's (the rest: other "
            "processes)\n"
            f"- Git: {git_state()}\n"
            f"- Heap: {HEAPS[args.heap]}\n"
            f"- Load average (1, 5, 15 min) before: {load_before}; after: {load_after}\n"
            f"- Data: {args.data.name} ({items} items); SASRec: max_len {args.max_len}, width "
            f"{args.dim}, {args.blocks} blocks, {args.heads} head(s), dropout {args.dropout}; "
            f"BCE with {args.negatives} negative(s) per position; Adam lr {args.lr} (rows and "
            f"encoder); batch {args.batch_size}; median of {args.steps} steps after "
            f"{args.warmup} warmup; ratios paired per step. Method: the docstring of "
            "benchmarks/sasrec_step.py.\n"
            f"- Parity: the sparse-Adam baseline's loss gap to hybridrec within the first "
            f"{PARITY_STEPS} steps, and the dense-Adam one's at the first step (a different "
            f"optimizer from there on), are at most {PARITY_TOL:.0e} (checked; the run stops "
            "otherwise)\n\n"
            f"{table}\n"
        )
        tmp.replace(args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
