"""Embedding microbenchmark: one lookup + gradient dedupe + row-optimizer update on a fused table,
the torch path (hybridrec.sparse.fused / hybridrec.optim.sparse) vs the Triton kernels
(hybridrec.kernels), side by side on the same table, ids and gradients.

    python -m benchmarks.lookup_update --device cuda --optimizer all \\
        --out benchmarks/results/lookup_update_h100.md        # dlrm_kaggle tables, batch 65536
    python -m benchmarks.lookup_update --device cpu --rows 100000 --batch-size 4096   # smoke

Default tables: the 26 dlrm_kaggle cardinalities (33.8M rows, conf/model/dlrm_kaggle.yaml);
`--rows R` instead splits R rows evenly over `--tables`. Each table gets batch * hotness ids
per batch, Zipf(`--zipf`)-distributed ranks scattered over the table by a fixed bijection
(hot rows are not adjacent). Bags are laid out table by table, as FusedEmbedding.flatten does.

Phases timed (median of `--steps` after `--warmup`, synced; `total` runs the three back to
back): `lookup` (pooled = sum of the bag's rows), `dedupe` (per-row gradient sums, sorted
unique rows), `update` (the optimizer on the touched rows). Bytes counted per phase, with
N = ids, B*T = bags, U = distinct rows, D = width, wb = weight bytes per value (ids, offsets
and sort traffic not counted, so the figures are lower bounds on traffic):
- lookup: N*D*wb read + B*T*D*4 written;
- dedupe: N*D*4 read (each id's bag gradient) + U*D*4 written;
- update: 2*U*D*wb (weight rows read and written) + U*D*4 (grads read) + optimizer state read
  and written: sgd 0, rowwise_adagrad 2*U*4, adam 2*2*U*D*4, adagrad 2*U*D*4.
GB/s = bytes / time; "% HBM" = time the bytes need at `--hbm-bw` (default 2.98e12 B/s,
H100 SXM's nominal; peak achievable is ~90% of it) / measured time.
On CPU the Triton rows need TRITON_INTERPRET=1 (tiny sizes only: the interpreter is slow).
HYBRIDREC_KERNELS=torch skips them.
"""

from __future__ import annotations

import argparse
import gc
import math
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import command_line, hardware, markdown_table, median, time_steps
from hybridrec.configure import load_model_config
from hybridrec.kernels import dispatch, lookup, row_update, segment
from hybridrec.kernels.lookup import pool
from hybridrec.kernels.segment import dedupe
from hybridrec.optim.sparse import (
    SPARSE_OPTIMIZERS,
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseSGD,
)

SPARSE_LR = {"sgd": 0.05, "rowwise_adagrad": 0.05, "adam": 0.001, "adagrad": 0.05}
HASH = 2654435761  # prime > any table size: rank -> (rank * HASH + 17) % n is a bijection


def table_sizes(args: argparse.Namespace) -> list[int]:
    if args.rows is None:
        return list(load_model_config("dlrm_kaggle").num_embeddings_per_feature)
    base, extra = divmod(args.rows, args.tables)
    return [base + (t < extra) for t in range(args.tables)]


def zipf_ids(n: int, count: int, s: float, gen: torch.Generator, device: torch.device):
    """`count` ids in [0, n): Zipf(s) ranks (inverse CDF of the continuous density x^-s on
    [1, n + 1)), scattered over the table by a fixed bijection."""
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    if abs(s - 1.0) < 1e-9:
        x = torch.exp(u * math.log(n + 1))
    else:
        a = 1.0 - s
        x = ((float(n + 1) ** a - 1.0) * u + 1.0) ** (1.0 / a)
    rank = (x.floor().long() - 1).clamp_(0, n - 1)
    return ((rank * HASH + 17) % n).to(device)


def make_batch(args, sizes: list[int], seed: int, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(seed)
    per_table = args.batch_size * args.hotness
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    rows = torch.cat(
        [zipf_ids(n, per_table, args.zipf, gen, device) + offsets[t] for t, n in enumerate(sizes)]
    )
    num_bags = args.batch_size * len(sizes)
    bags = torch.arange(num_bags, device=device).repeat_interleave(args.hotness)
    grad = torch.randn(num_bags, args.dim, generator=gen).to(device)
    return {"rows": rows, "bags": bags, "num_bags": num_bags, "grad": grad}


def build_optimizer(name: str):
    lr = SPARSE_LR[name]
    classes = {
        "sgd": SparseSGD,
        "rowwise_adagrad": RowWiseAdagrad,
        "adam": SparseAdam,
        "adagrad": SparseAdagrad,
    }
    return classes[name](lr)


def _offsets(bags: torch.Tensor, num_bags: int) -> torch.Tensor:
    starts = torch.arange(num_bags + 1, device=bags.device, dtype=bags.dtype)
    return torch.searchsorted(bags, starts)


def torch_path(opt, weight, state):
    """(lookup, dedupe, update) callables of the torch path (`pool` and `dedupe` would take
    the Triton kernels where they run: held to torch ops here)."""

    def lookup(b):
        with dispatch.use_kernels("torch"):
            return pool(weight, b["rows"], b["bags"], None, b["num_bags"])

    def dedup(b):
        with dispatch.use_kernels("torch"):
            return dedupe(b["rows"], b["bags"], None, b["grad"])

    def update(rows, grads, step):
        with dispatch.use_kernels("torch"):
            opt.update(weight, state, rows, grads, step)

    return lookup, dedup, update


def triton_path(opt, weight, state):
    """(lookup, dedupe, update) callables of the Triton kernels."""

    def lookup(b):
        offsets = _offsets(b["bags"], b["num_bags"])
        return lookup.pooled_lookup(weight, b["rows"], offsets, None, b["num_bags"])

    def dedup(b):
        return segment.segment_grads(b["grad"], b["rows"], b["bags"], None)

    def update(rows, grads, step):
        row_update.update(opt, weight, state, rows, grads, step)

    return lookup, dedup, update


def phase_bytes(opt_name: str, n: int, bags: int, u: int, d: int, wb: int) -> dict[str, float]:
    state = {
        "sgd": 0,
        "rowwise_adagrad": 2 * u * 4,
        "adam": 2 * 2 * u * d * 4,
        "adagrad": 2 * u * d * 4,
    }[opt_name]
    out = {
        "lookup": n * d * wb + bags * d * 4,
        "dedupe": n * d * 4 + u * d * 4,
        "update": 2 * u * d * wb + u * d * 4 + state,
    }
    out["total"] = sum(out.values())
    return out


def measure(path, batches, device, args) -> dict[str, float]:
    """Median ms of each phase and of the three back to back."""
    lookup, dedup, update = path
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    pre = [dedup(b) for b in batches]  # update inputs, so the update is timed alone
    counter = {"step": 0}

    def run(fn: Callable[[int], object]) -> float:
        def step(i: int) -> None:
            fn(i)
            sync()

        return 1e3 * median(time_steps(step, args.steps, args.warmup, before=sync))

    def do_update(i: int) -> None:
        counter["step"] += 1
        rows, grads = pre[i % len(batches)]
        update(rows, grads, counter["step"])

    def do_total(i: int) -> None:
        b = batches[i % len(batches)]
        lookup(b)
        rows, grads = dedup(b)
        counter["step"] += 1
        update(rows, grads, counter["step"])

    return {
        "lookup": run(lambda i: lookup(batches[i % len(batches)])),
        "dedupe": run(lambda i: dedup(batches[i % len(batches)])),
        "update": run(do_update),
        "total": run(do_total),
    }


def check_agreement(batch, weight) -> str:
    """Max |difference| of the two paths' pooled output and deduplicated gradients."""
    a = pool(weight, batch["rows"], batch["bags"], None, batch["num_bags"])
    offsets = _offsets(batch["bags"], batch["num_bags"])
    b = lookup.pooled_lookup(weight, batch["rows"], offsets, None, batch["num_bags"])
    ra, ga = dedupe(batch["rows"], batch["bags"], None, batch["grad"])
    rb, gb = segment.segment_grads(batch["grad"], batch["rows"], batch["bags"], None)
    assert torch.equal(ra, rb), "the two paths found different unique rows"
    return (
        f"pooled max |diff| {(a - b).abs().max().item():.2e}, "
        f"dedupe grads max |diff| {(ga - gb).abs().max().item():.2e}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--rows", type=int, default=None, help="default: dlrm_kaggle's 26 tables")
    p.add_argument("--tables", type=int, default=26, help="tables when --rows is given")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=65536)
    p.add_argument("--hotness", type=int, default=1)
    p.add_argument(
        "--optimizer", default="all", help="sgd | rowwise_adagrad | adam | adagrad | all"
    )
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batches", type=int, default=2, help="distinct batches, cycled")
    p.add_argument("--hbm-bw", type=float, default=2.98e12, help="bytes/s for the %% column")
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    names = SPARSE_OPTIMIZERS if args.optimizer == "all" else tuple(args.optimizer.split(","))
    unknown = set(names) - set(SPARSE_OPTIMIZERS)
    if unknown:
        choices = ", ".join((*SPARSE_OPTIMIZERS, "all"))
        p.error(f"--optimizer: unknown {sorted(unknown)}; one of {choices}")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)

    sizes = table_sizes(args)
    weight = (torch.randn(sum(sizes), args.dim, device=device) * 0.01).to(dtype)
    batches = [make_batch(args, sizes, s, device) for s in range(args.batches)]
    n, num_bags = batches[0]["rows"].numel(), batches[0]["num_bags"]
    u = sum(torch.unique(b["rows"]).numel() for b in batches) / len(batches)
    with_triton = dispatch.available(weight)
    agreement = check_agreement(batches[0], weight) if with_triton else "triton path not run"
    print(
        f"{len(sizes)} tables, {sum(sizes):,} rows x {args.dim} {args.dtype}; {n:,} ids, "
        f"{num_bags:,} bags, {u:,.0f} distinct rows per batch; {agreement}",
        flush=True,
    )

    rows = []
    for name in names:
        opt = build_optimizer(name)
        state = {}
        for key, kind in opt.state_spec().items():
            state[key] = torch.zeros(kind.shape(sum(sizes), args.dim), device=device)
        nbytes = phase_bytes(name, n, num_bags, round(u), args.dim, weight.element_size())
        paths = [("torch", torch_path(opt, weight, state))]
        if with_triton:
            paths.append(("triton", triton_path(opt, weight, state)))
        for label, path in paths:
            ms = measure(path, batches, device, args)
            for phase in ("lookup", "dedupe", "update", "total"):
                b, t = nbytes[phase], ms[phase] / 1e3
                gbs = b / t / 1e9
                pct = 100 * b / args.hbm_bw / t
                rows.append(
                    [label, name, phase, f"{ms[phase]:.3f}", f"{b / 1e6:,.1f}", f"{gbs:,.1f}"]
                    + [f"{pct:.1f}"]
                )
                print(
                    f"{label:7s} {name:16s} {phase:7s} {ms[phase]:9.3f} ms "
                    f"{b / 1e6:10,.1f} MB {gbs:9,.1f} GB/s {pct:6.1f}% HBM",
                    flush=True,
                )
        del state, paths
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if args.out:
        table = markdown_table(
            ["path", "optimizer", "phase", "ms", "MB moved", "GB/s", "% HBM"], rows
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            f"# Embedding lookup + dedupe + update: torch vs Triton\n\n"
            f"Command: `{command_line()}`\n\n- Hardware: {hardware()}\n"
            f"- {len(sizes)} tables, {sum(sizes):,} rows x {args.dim} {args.dtype}; batch "
            f"{args.batch_size}, hotness {args.hotness}, Zipf {args.zipf}: {n:,} ids, "
            f"{num_bags:,} bags, {u:,.0f} distinct rows per batch; {args.batches} distinct "
            f"batches, median of {args.steps} after {args.warmup} warmup; % HBM against "
            f"{args.hbm_bw:.3g} B/s.\n- Agreement: {agreement}.\n"
            f"- Bytes per phase: see the docstring of benchmarks/lookup_update.py.\n\n"
            f"{table}\n"
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
