"""CPU sparse backward + update alone, in ns per id: hybridrec's torch path now, its former path
and plain PyTorch's EmbeddingBag(sparse=True) + optimizer, interleaved in one process.

    python -m benchmarks.sparse_update --optimizer all \\
        --out benchmarks/results/sparse_update_cpu.md     # one process and 2-rank row-wise shapes

Model (issue 22): 8 tables of 1K-1M rows, dim 32, global batch 4096, hotness 1, Zipf(1.05) ids
scattered over each table (benchmarks.lookup_update.zipf_ids). Shapes: `one` is one process
holding every table; `rowwise2` is rank 0 of a 2-way row-wise split (the first half of each
table's rows, and the global batch's ids that fall in it). Paths, given the pooled gradient:
- `former`: cpu_rows.dedupe_reference (sorted unique + index_add_ of the [N, D] per-id
  gradients) + optim.sparse.reference_update (index_add_ / index_copy_ per tensor);
- `torch`: hybridrec's torch path: kernels.segment.dedupe (one stable sort, index_add_ in id
  order) + the optimizer's update with torch ops (hybridrec.kernels.native disabled);
- `hybridrec`: what training runs on the CPU: the native kernels (kernels.native: a hashing
  dedupe, then one pass over each touched row per optimizer);
- `plain`: one nn.EmbeddingBag(sparse=True) per table, pooled.backward(grad) (graph kept) +
  torch.optim.SGD / SparseAdam / Adagrad (no plain row-wise Adagrad: not run).
Each repeat times `--steps` iterations of every path in turn (median per path); the best of
`--repeats` repeats is reported, since the machine may be shared (load averages printed).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import (
    command_line,
    git_state,
    hardware,
    load_average,
    markdown_table,
    median,
    time_steps,
)
from benchmarks.lookup_update import SPARSE_LR, build_optimizer, zipf_ids
from hybridrec.kernels import dispatch, native
from hybridrec.kernels.cpu_rows import dedupe_reference
from hybridrec.kernels.segment import dedupe, dedupe_any_order
from hybridrec.optim.sparse import SPARSE_OPTIMIZERS, reference_update

SIZES = (1000, 3000, 10_000, 30_000, 100_000, 300_000, 1_000_000, 1_000_000)
SHAPES = {"one": 1, "rowwise2": 2}
PATHS = ("former", "torch", "hybridrec", "plain")  # shape -> row shards (rank 0's rows and ids)


def make_case(args: argparse.Namespace, shards: int, seed: int) -> dict:
    """Rank 0's tables (the first 1/shards of each table's rows) and the global batch's ids
    among them: group rows [N], bags [N] (non-decreasing), per-table (ids, offsets), grad."""
    gen = torch.Generator().manual_seed(seed)
    sizes, rows, bags, per_table = [], [], [], []
    base = bag_base = 0
    for n in args.sizes:
        ids = zipf_ids(n, args.batch_size * args.hotness, args.zipf, gen, torch.device("cpu"))
        local = -(-n // shards)
        bag = torch.arange(args.batch_size).repeat_interleave(args.hotness)
        keep = ids < local
        ids, bag = ids[keep], bag[keep]
        offsets = torch.searchsorted(bag, torch.arange(args.batch_size))
        sizes.append(local)
        per_table.append((ids, offsets))
        rows.append(ids + base)
        bags.append(bag + bag_base)
        base += local
        bag_base += args.batch_size
    grad = torch.randn(bag_base, args.dim, generator=gen)
    return {
        "sizes": sizes,
        "rows": torch.cat(rows),
        "bags": torch.cat(bags),
        "per_table": per_table,
        "grad": grad,
    }


# each optimizer's state: row-wise [R] or element-wise [R, D]
STATE = {
    "sgd": {},
    "adagrad": {"sum": "element"},
    "rowwise_adagrad": {"sum": "row"},
    "adam": {"exp_avg": "element", "exp_avg_sq": "element"},
}


def _state(opt, rows: int, dim: int) -> dict[str, torch.Tensor]:
    shape = {"row": (rows,), "element": (rows, dim)}
    return {n: torch.zeros(shape[kind]) for n, kind in STATE[opt.name].items()}


def hybridrec_paths(name: str, case: dict, dim: int) -> dict[str, Callable[[int], None]]:
    """`former` and `hybridrec` steps, each on its own copy of the weight and state."""
    out = {}
    total = sum(case["sizes"])
    for label in ("former", "torch", "hybridrec"):
        opt = build_optimizer(name)
        weight, state = torch.randn(total, dim) * 0.01, _state(opt, total, dim)

        def step(i: int, opt=opt, weight=weight, state=state, label=label) -> None:
            rows, bags, grad = case["rows"], case["bags"], case["grad"]
            if label == "former":
                unique_rows, grads = dedupe_reference(rows, bags, None, grad)
                reference_update(opt, weight, state, unique_rows, grads, i + 1)
            elif label == "torch":
                with native.disabled():
                    unique_rows, grads = dedupe(rows, bags, None, grad)
                    opt.update(weight, state, unique_rows, grads, i + 1)
            else:
                unique_rows, grads = dedupe_any_order(rows, bags, None, grad)
                opt.update(weight, state, unique_rows, grads, i + 1)

        out[label] = step
    return out


def plain_path(name: str, case: dict, dim: int) -> Callable[[int], None] | None:
    """nn.EmbeddingBag(sparse=True) per table + torch's sparse optimizer: backward + step."""
    optim = {"sgd": torch.optim.SGD, "adam": torch.optim.SparseAdam, "adagrad": torch.optim.Adagrad}
    if name not in optim:
        return None
    tables = [nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in case["sizes"]]
    params = [p for t in tables for p in t.parameters()]
    opt = optim[name](params, lr=SPARSE_LR[name])
    pooled = torch.cat(
        [t(ids, offsets) for t, (ids, offsets) in zip(tables, case["per_table"], strict=True)]
    )
    grad = case["grad"]

    def step(i: int) -> None:
        pooled.backward(grad, retain_graph=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure(paths: dict, args: argparse.Namespace) -> dict[str, float]:
    """Best over repeats of each path's median ms; the paths take turns within a repeat."""
    best = {k: float("inf") for k in paths}
    for _ in range(args.repeats):
        for label, step in paths.items():
            ms = 1e3 * median(time_steps(step, args.steps, args.warmup))
            best[label] = min(best[label], ms)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--optimizer", default="sgd", help="sgd | rowwise_adagrad | adam | adagrad | all"
    )
    p.add_argument("--shapes", default="one,rowwise2", help="comma list of: one, rowwise2")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="rows per table")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--hotness", type=int, default=1)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    names = SPARSE_OPTIMIZERS if args.optimizer == "all" else tuple(args.optimizer.split(","))
    shapes = args.shapes.split(",")
    bad = (set(names) - set(SPARSE_OPTIMIZERS)) | (set(shapes) - set(SHAPES))
    if bad:
        p.error(
            f"unknown {sorted(bad)}: --optimizer takes {', '.join(SPARSE_OPTIMIZERS)} or all"
            f", --shapes {', '.join(SHAPES)}"
        )
    torch.manual_seed(0)
    load_before = load_average()
    print(f"load average before: {load_before}; threads {torch.get_num_threads()}", flush=True)
    rows = []
    with dispatch.use_kernels("torch"):
        for shape in shapes:
            case = make_case(args, SHAPES[shape], seed=1)
            n = case["rows"].numel()
            u = torch.unique(case["rows"]).numel()
            for name in names:
                paths = hybridrec_paths(name, case, args.dim)
                plain = plain_path(name, case, args.dim)
                if plain is not None:
                    paths["plain"] = plain
                ms = measure(paths, args)
                cells = [f"{ms[k]:.3f}" if k in ms else "-" for k in PATHS]
                ns = [f"{1e6 * ms[k] / n:.0f}" if k in ms else "-" for k in PATHS]
                ratios = [
                    f"{ms[k] / ms['hybridrec']:.2f}" if k in ms else "-"
                    for k in ("former", "torch", "plain")
                ]
                rows.append([shape, name, f"{n:,}", f"{u:,}", *cells, *ns, *ratios])
                print(" | ".join(rows[-1]), flush=True)
    load_after = load_average()
    print(f"load average after: {load_after}", flush=True)
    headers = ["shape", "optimizer", "ids", "distinct rows"]
    headers += [f"{k} ms" for k in PATHS] + [f"{k} ns/id" for k in PATHS]
    headers += ["former / hybridrec", "torch / hybridrec", "plain / hybridrec"]
    table = markdown_table(headers, rows)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            "# CPU sparse backward + update: hybridrec's native kernels, its torch path, its "
            "former path, plain PyTorch\n\n"
            f"Command: `{command_line()}`\n\n- Hardware: {hardware()}; "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
            f"torch threads {torch.get_num_threads()}\n- Git: {git_state()}\n"
            f"- Load average (1, 5, 15 min) before: {load_before}; after: {load_after}\n"
            f"- {len(args.sizes)} tables of {args.sizes} rows, dim {args.dim}, global batch "
            f"{args.batch_size}, hotness {args.hotness}, Zipf {args.zipf}; best of "
            f"{args.repeats} interleaved repeats of the median of {args.steps} steps after "
            f"{args.warmup} warmup. Paths: see the docstring of benchmarks/sparse_update.py.\n\n"
            f"{table}\n"
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
