"""hybridrec's sequence lookup vs TorchRec's sharded EmbeddingCollection on CPU/gloo, whole
training steps under the same dense part, side by side in the same processes (issue 39).

The model: an item table (`--items` rows) and a category table (`--categories` rows), both
`--dim` wide. Each sample has a history of 1..`--length` items (oldest first; lengths
log-normal, mean about 10, a few at the maximum) read as a sequence feature (a row per
position, not pooled), the categories of those items as a second sequence feature, and a
target item that shares the item table with the history. The dense part (`SequenceDense`,
the same module and initial weights on both sides): learned positions added to item +
category rows, attention of the target over the history's positions (masked past each
history's end), and an MLP on (read, target, read * target) -> a logit; BCE against labels.

Both systems, on every rank of W gloo processes (one torch thread each):
- hybridrec: the model declares `EmbeddingTables` with `Feature(..., pooling="none")` and goes
  through `hybridrec.parallelize` (sharding none at W=1, else table_wise or row_wise); the
  sequences come as padded [B, L] ids (-1 after the end), the output as [B, L, D] with zeros
  there and `mask()`;
- TorchRec: `torchrec.EmbeddingCollection` (one row per id, JaggedTensor outputs; the item
  table lists both item features) under `DistributedModelParallel` with the same plan, on
  FBGEMM's fused CPU kernels with the optimizer applied in the backward
  (`apply_optimizer_in_backward`), its input a KeyedJaggedTensor (the same ids without the
  padding), its sequence outputs padded to [B, L, D] by FBGEMM's `jagged_to_padded_dense`
  (what `JaggedTensor.to_padded_dense` calls) and the mask taken from the lengths; the copy
  of the dense part under DDP.
Each system gets its batch in its own input format, made before the timing. Both hold the
same initial rows (hybridrec's, gathered from its shards) and dense weights, and train with
the same sparse optimizer (SGD, or row-wise Adagrad: FBGEMM's EXACT_ROWWISE_ADAGRAD) and the
same dense Adam. The two systems share each rank's heap: by default (`--heap held`) each
rank keeps its freed memory there (benchmarks.paired.hold_heap), where glibc's own trimming
would make one system's step pay page faults the other's buffers caused.

Gradient scaling: each rank's loss is the mean over its B/W samples. hybridrec divides the
embedding gradients by W where they leave its model (hybridrec/shard.py); TorchRec's sequence
all-to-all divides them in its backward (comm_ops.All2All_Seq_Req.backward, under
get_gradient_division(), on by default), as its pooled one does. So no scaling is added to
TorchRec's side (only were its division switched off would ScaleGrad(1/W) stand in for it:
torchrec_step.torchrec_scale); with 1/W added twice the losses part at the second step
(4e-7 at W=2, 8e-6 by step 8), which the parity check catches.

Parity, checked before any time is reported: the largest gap between the two systems'
losses over the first 10 steps (any rank) is printed per mode, and above 1e-6 the benchmark
exits 1 naming the mode and the step, and writes no report. Timing and ratios are
benchmarks/paired.py's, as in benchmarks/torchrec_step.py: per step the systems run one after
the other on the same batch, each after a barrier, in alternating order; a step's time is the
slowest rank's; the ratio is the median over steps of (TorchRec's step / hybridrec's step in
the same step), with quartiles (> 1: hybridrec faster). Each step's CPU time, summed over the
ranks (each rank's time.process_time(), its gloo threads included: what the step computed,
not the time other processes on a shared machine held the cores), is paired the same way.

TorchRec is not a dependency of hybridrec: the venv recipe is benchmarks/torchrec_step.py's.

    OMP_NUM_THREADS=1 /tmp/trvenv/bin/python -m benchmarks.sequence_torchrec \\
        --out benchmarks/results/sequence_torchrec_cpu.md
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import hybridrec
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
from benchmarks.paired import (
    HEAPS,
    PARITY_STEPS,
    PARITY_TOL,
    heap_option,
    loss_gaps,
    paired_ratio,
    parity_failures,
    slowest,
    step_order,
    use_heap,
)
from benchmarks.torchrec_step import _torchrec_available, torchrec_scale
from hybridrec import EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.distributed import DistEnv
from hybridrec.distributed.comm import ScaleGrad
from hybridrec.optim import RowWiseAdagrad, SparseSGD
from hybridrec.sparse.api import embedding_modules
from tests.distributed.harness import spawn

MODES = ("table_wise", "row_wise")
OPTIMIZERS = ("sgd", "rowwise_adagrad")
SPARSE_LR = {"sgd": 0.05, "rowwise_adagrad": 0.05}
DENSE_LR = 1e-3
SEED = 11
# the features in the batch's column order, each with its table: the history and its items'
# categories (sequences of `length`), the target item (one id)
SEQUENCES = ("history", "history_cat")
NAMES = {"hybridrec": "hybridrec", "torchrec": "TorchRec EmbeddingCollection"}


class SequenceDense(nn.Module):
    """The dense part both systems share: history rows + category rows + learned positions,
    the target's attention over the history's real positions, an MLP on (read, target,
    read * target). forward(history [B, L, D], cats [B, L, D], mask [B, L] bool (at least one
    True per row), target [B, D]) -> logits [B]."""

    def __init__(self, dim: int, length: int, hidden: int = 64) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.randn(length, dim) * 0.02)
        self.query = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(3 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.scale = 1.0 / math.sqrt(dim)

    def forward(
        self, history: torch.Tensor, cats: torch.Tensor, mask: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        h = history + cats + self.position
        scores = torch.bmm(h, self.query(target).unsqueeze(2)).squeeze(2) * self.scale
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=1)
        read = torch.bmm(weights.unsqueeze(1), h).squeeze(1)
        return self.mlp(torch.cat([read, target, read * target], dim=1)).squeeze(1)


class HybridrecModel(nn.Module):
    """hybridrec's side: the tables declared with sequence features, then SequenceDense."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        length = args.length
        self.tables = EmbeddingTables(
            [Table("item", args.items, args.dim), Table("category", args.categories, args.dim)],
            [
                Feature("history", "item", hotness=length, pooling="none"),
                Feature("history_cat", "category", hotness=length, pooling="none"),
                Feature("target", "item"),
            ],
            namespace="",
        )
        self.dense = SequenceDense(args.dim, length)

    def forward(self, ids: KeyedIds) -> torch.Tensor:
        e = self.tables(ids)
        return self.dense(e["history"], e["history_cat"], e.mask("history"), e["target"])


@dataclass
class Batch:
    """One rank's slice of a global batch in both systems' formats: `keyed` (hybridrec:
    padded [b, 2L + 1] ids), `kjt` (TorchRec: the same ids, jagged), `lengths` [b], `labels`."""

    keyed: KeyedIds
    kjt: object
    lengths: torch.Tensor
    labels: torch.Tensor


def make_batches(args: argparse.Namespace, rank: int, world: int, count: int) -> list[Batch]:
    """`count` global batches (the same on every rank), this rank's slice of each. Items are
    skewed (popular rows repeat across positions and samples), each item's category fixed;
    history lengths log-normal (median 6, mean about 10), clamped to 1..L."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(args.seed)
    category_of = torch.randint(0, args.categories, (args.items,), generator=g)
    b, length = args.batch_size, args.length
    part = slice(rank * b // world, (rank + 1) * b // world)
    out = []
    for _ in range(count):
        items = (torch.rand(b, length + 1, generator=g) ** 3 * args.items).long()
        lengths = (torch.randn(b, generator=g) + math.log(6)).exp().round().clamp(1, length)
        lengths = lengths.long()[part]
        items = items[part]
        history = items[:, :length]
        mask = torch.arange(length).expand(len(lengths), length) < lengths.unsqueeze(1)
        history = history.masked_fill(~mask, -1)
        cats = category_of[history.clamp(min=0)].masked_fill(~mask, -1)
        target = items[:, length:]
        keyed = KeyedIds(
            torch.cat([history, cats, target], 1),
            [*SEQUENCES, "target"],
            [length, length, 1],
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[*SEQUENCES, "target"],
            values=torch.cat([history[mask], cats[mask], target.reshape(-1)]),
            lengths=torch.cat([lengths, lengths, torch.ones_like(lengths)]),
        )
        labels = (torch.rand(b, generator=g) < 0.3).float()[part]
        out.append(Batch(keyed, kjt, lengths, labels))
    return out


def full_tables(model: nn.Module, env: DistEnv, args: argparse.Namespace) -> dict:
    """Every table's rows as hybridrec initialised them, assembled from all ranks' shards
    (table- and row-wise shards are disjoint: a sum over ranks of zero-filled copies)."""
    rows = {"item": args.items, "category": args.categories}
    full = {name: torch.zeros(n, args.dim) for name, n in rows.items()}
    for m in embedding_modules(model):
        for spec, weight, _ in m.shard_views():
            rs, cs = slice(spec.row_start, spec.row_end), slice(spec.col_start, spec.col_end)
            full[spec.table][rs, cs] = weight
    if env.group is not None and env.world_size > 1:
        for t in full.values():
            dist.all_reduce(t, group=env.group)
    return full


class TorchRecSide(nn.Module):
    """TorchRec's sharded EmbeddingCollection under a copy of hybridrec's dense part."""

    def __init__(
        self, env: DistEnv, args: argparse.Namespace, mode: str, rows: dict, dense: nn.Module
    ) -> None:
        super().__init__()
        self.length = args.length
        self.ec = _shard(_collection(args), env, mode)
        _copy_rows(self.ec, rows)
        copy = SequenceDense(args.dim, args.length)
        copy.load_state_dict(dense.state_dict())
        if env.world_size > 1:
            copy = nn.parallel.DistributedDataParallel(copy, broadcast_buffers=False)
        self.dense = copy
        self.scale = torchrec_scale(env.world_size)

    def _rows(self, jt) -> torch.Tensor:  # noqa: ANN001
        values = jt.values()
        return values if self.scale is None else ScaleGrad.apply(values, self.scale)

    def forward(self, b: Batch) -> torch.Tensor:
        out = self.ec(b.kjt)  # dict[str, JaggedTensor]
        pad = torch.ops.fbgemm.jagged_to_padded_dense
        history, cats = (
            pad(self._rows(out[k]), [out[k].offsets()], [self.length], 0.0) for k in SEQUENCES
        )
        mask = torch.arange(self.length).expand(len(b.lengths), -1) < b.lengths.unsqueeze(1)
        return self.dense(history, cats, mask, self._rows(out["target"]))


def _collection(args: argparse.Namespace) -> nn.Module:
    """The tables as TorchRec's EmbeddingCollection, the sparse optimizer in its backward."""
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    configs = [
        EmbeddingConfig(
            name="item",
            embedding_dim=args.dim,
            num_embeddings=args.items,
            feature_names=["history", "target"],
        ),
        EmbeddingConfig(
            name="category",
            embedding_dim=args.dim,
            num_embeddings=args.categories,
            feature_names=["history_cat"],
        ),
    ]
    ec = EmbeddingCollection(tables=configs, device=torch.device("cpu"))
    lr = SPARSE_LR[args.optimizer]
    if args.optimizer == "sgd":
        apply_optimizer_in_backward(torch.optim.SGD, ec.parameters(), {"lr": lr})
    else:
        opt_args = {"lr": lr, "eps": 1e-8}
        apply_optimizer_in_backward(TorchRecRowWiseAdagrad, ec.parameters(), opt_args)
    return ec


def _shard(ec: nn.Module, env: DistEnv, mode: str) -> nn.Module:
    """DistributedModelParallel over `ec` with this mode's plan (one rank: all on it;
    table-wise: the item table on rank 0, categories on rank 1)."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    world = env.world_size
    if world == 1 or mode == "table_wise":
        per_table = {"item": table_wise(rank=0), "category": table_wise(rank=1 % world)}
    else:
        per_table = {"item": row_wise(), "category": row_wise()}
    sharder = EmbeddingCollectionSharder()
    module_plan = construct_module_sharding_plan(
        ec, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    group = env.group if env.group is not None else dist.GroupMember.WORLD
    return DistributedModelParallel(
        ec,
        env=ShardingEnv.from_process_group(group),
        device=torch.device("cpu"),
        plan=ShardingPlan({"": module_plan}),
        sharders=[sharder],
    )


def _copy_rows(sharded: nn.Module, rows: dict[str, torch.Tensor]) -> None:
    """hybridrec's initial rows into every FBGEMM table shard this rank holds (through the
    kernels' own weight views, as benchmarks/torchrec_step.py's _copy_rows)."""
    copied = 0
    ec = sharded.module
    kernels = [k for lookup in ec._lookups for k in lookup._emb_modules]
    with torch.no_grad():
        for module in kernels:
            weights = module.split_embedding_weights()
            for spec, weight in zip(module._config.embedding_tables, weights, strict=True):
                (r, c), (h, w) = spec.local_metadata.shard_offsets, spec.local_metadata.shard_sizes
                weight.copy_(rows[spec.name][r : r + h, c : c + w])
                copied += 1
    if not copied:
        raise RuntimeError("found no FBGEMM table to copy hybridrec's rows into")


def _stepper(params, forward) -> object:  # noqa: ANN001
    """A training step: forward(batch) -> logits, BCE, backward (the sparse update inside
    it), the dense Adam step over `params`. Returns the loss."""
    opt = torch.optim.Adam(params, lr=DENSE_LR)

    def step(b: Batch) -> torch.Tensor:
        loss = nn.functional.binary_cross_entropy_with_logits(forward(b), b.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _keyed(model: nn.Module):  # noqa: ANN202
    """hybridrec's forward on a Batch: the model reads the padded ids (KeyedIds)."""
    return lambda b: model(b.keyed)


def run_rank(env: DistEnv, args: argparse.Namespace, modes: list[str]) -> dict:
    """Per mode: this rank's step times, CPU times and losses of both systems, interleaved in
    alternating order (step_order), every step on the same batch after a barrier."""
    out = {}
    use_heap(args.heap)
    barrier = (lambda: dist.barrier(group=env.group)) if env.group is not None else None
    batches = make_batches(args, env.rank, env.world_size, args.warmup + args.steps)
    for mode in modes:
        torch.manual_seed(args.seed)  # the same dense weights on every rank
        sparse = SparseSGD if args.optimizer == "sgd" else RowWiseAdagrad
        ours = hybridrec.parallelize(
            HybridrecModel(args),
            batch_size=args.batch_size,
            sparse_optimizer=sparse(SPARSE_LR[args.optimizer]),
            group=env.group,
            sharding="none" if env.world_size == 1 else mode,
            seed=SEED,
        )
        inner = ours.module if isinstance(ours, nn.parallel.DistributedDataParallel) else ours
        theirs = TorchRecSide(env, args, mode, full_tables(inner, env, args), inner.dense)
        dense_params = [p for n, p in theirs.named_parameters() if n.startswith("dense.")]
        systems = {
            "hybridrec": _stepper(ours.parameters(), _keyed(ours)),
            "torchrec": _stepper(dense_params, theirs),
        }
        times: dict[str, list[float]] = {k: [] for k in systems}
        cpu: dict[str, list[float]] = {k: [] for k in systems}
        losses: dict[str, list[float]] = {k: [] for k in systems}
        for i, b in enumerate(batches):
            for name in step_order(list(systems), i):
                if barrier is not None:
                    barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                loss = systems[name](b)
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
                losses[name].append(float(loss))
        out[mode] = {"times": times, "cpu": cpu, "losses": losses}
        del ours, inner, theirs, systems
        gc.collect()
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="hybridrec's sequence lookup vs TorchRec's EmbeddingCollection (FBGEMM "
        "CPU): training steps on CPU/gloo under one dense part, interleaved",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--world-sizes", default="2", help="comma-separated world sizes")
    p.add_argument("--modes", default=",".join(MODES), help="sharding modes for W > 1")
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    p.add_argument("--items", type=int, default=50_000, help="item table rows")
    p.add_argument("--categories", type=int, default=1_000, help="category table rows")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--length", type=int, default=50, help="the sequences' maximum length L")
    p.add_argument("--batch-size", type=int, default=2048, help="global batch")
    p.add_argument("--steps", type=int, default=30, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="the batches' and dense weights' seed")
    p.add_argument("--timeout", type=float, default=900, help="seconds per world size")
    heap_option(p)
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    args.world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or set(args.modes) - set(MODES):
        p.error(f"--modes takes {', '.join(MODES)}")
    if args.warmup + args.steps < PARITY_STEPS:
        p.error(f"--warmup + --steps must be at least {PARITY_STEPS}: the parity check's steps")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.length < 2:
        p.error("--length must be at least 2")
    return args


def summarise(world: int, mode: str, per_rank: list[dict]) -> tuple[list, list[str], str]:
    """(the report's row, parity failures, the parity line) of one (world size, mode)."""
    ours = slowest([r["times"]["hybridrec"] for r in per_rank])
    theirs = slowest([r["times"]["torchrec"] for r in per_rank])
    mid, q1, q3 = paired_ratio(theirs, ours)
    cpu_ours, cpu_theirs = ([sum(ts) for ts in zip(*[r["cpu"][k] for r in per_rank], strict=True)]
                            for k in ("hybridrec", "torchrec"))  # fmt: skip
    cpu_mid, cpu_q1, cpu_q3 = paired_ratio(cpu_theirs, cpu_ours)
    losses = [r["losses"] for r in per_rank]
    first = loss_gaps(losses, "hybridrec", PARITY_STEPS)
    whole = loss_gaps(losses, "hybridrec", None)
    label = f"W={world} {'one process' if world == 1 else mode}"
    failures = parity_failures(label, first, NAMES, "hybridrec")
    gap = f"{first['torchrec'][0]:.0e} / {whole['torchrec'][0]:.0e}"
    parity = f"{label}: loss gap to hybridrec, first {PARITY_STEPS} / all steps: {gap}"
    row = [world, "one process" if world == 1 else mode]
    row += [f"{1e3 * median(ours):.2f}", f"{1e3 * median(theirs):.2f}"]
    row += [f"{mid:.2f} ({q1:.2f}-{q3:.2f})"]
    row += [f"{1e3 * median(cpu_ours):.2f}", f"{1e3 * median(cpu_theirs):.2f}"]
    row += [f"{cpu_mid:.2f} ({cpu_q1:.2f}-{cpu_q3:.2f})"]
    row += [f"{losses[0]['hybridrec'][-1]:.6f}", gap]
    return row, failures, parity


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = _torchrec_available()
    if why is not None:
        print(
            f"sequence_torchrec: TorchRec is not importable here ({why}); see "
            "benchmarks/torchrec_step.py's docstring for a venv that has it",
            file=sys.stderr,
        )
        return 2
    import torchrec

    torch.set_num_threads(1)
    load_before = load_average()
    busy0, own0, t0 = *cpu_seconds(), time.monotonic()
    print(f"# {hardware()}; load average {load_before}", flush=True)
    rows, failures = [], []
    for world in args.world_sizes:
        modes = ["none"] if world == 1 else args.modes
        results = spawn(world, run_rank, args, modes, timeout=args.timeout)
        for mode in modes:
            row, failed, parity = summarise(world, mode, [r[mode] for r in results])
            rows.append(row)
            failures += failed
            print(parity, flush=True)
            print(" | ".join(map(str, row)), flush=True)
    load_after = load_average()
    busy1, own1 = cpu_seconds()
    busy, own, wall = busy1 - busy0, own1 - own0, time.monotonic() - t0
    headers = ["W", "mode", "hybridrec ms", "TorchRec EC ms"]
    headers += ["TorchRec EC / hybridrec, paired (quartiles)"]
    headers += ["hybridrec CPU ms", "TorchRec EC CPU ms", "CPU ratio, paired (quartiles)"]
    headers += ["last loss"]
    headers += [f"max loss gap, first {PARITY_STEPS} / all steps"]
    table = markdown_table(headers, rows)
    print(table)
    if failures:
        for line in failures:
            print(f"sequence_torchrec: {line}", file=sys.stderr)
        print("sequence_torchrec: no report written", file=sys.stderr)
        return 1
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(
            "# hybridrec sequence features vs TorchRec EmbeddingCollection on CPU/gloo\n\n"
            f"Command: `{command_line()}`\n\n"
            f"- Machine: {hardware()}; one torch thread per rank\n"
            f"- CPU time on the machine during the run: {busy:.0f} CPU-s in {wall:.0f} s on "
            f"{host_cores()} cores, {own:.0f} of them this benchmark's (the rest: other "
            "processes)\n"
            f"- TorchRec {torchrec.__version__}, fbgemm-gpu-cpu (FBGEMM's fused CPU "
            "backward-update)\n"
            f"- Git: {git_state()}\n"
            f"- Heap: {HEAPS[args.heap]}\n"
            f"- Load average (1, 5, 15 min) before: {load_before}; after: {load_after}\n"
            f"- Model: items {args.items} x {args.dim}, categories {args.categories} x "
            f"{args.dim}; two sequence features of at most {args.length} ids (history, its "
            f"categories) and a target item; sparse {args.optimizer} (lr "
            f"{SPARSE_LR[args.optimizer]}), dense Adam (lr {DENSE_LR}); global batch "
            f"{args.batch_size}; median of {args.steps} steps after {args.warmup} warmup, "
            "slowest rank per step; ratios paired per step. Method: the docstring of "
            "benchmarks/sequence_torchrec.py.\n"
            f"- Parity: every loss gap to hybridrec within the first {PARITY_STEPS} steps is "
            f"at most {PARITY_TOL:.0e} (checked; the run stops otherwise)\n\n"
            f"{table}\n"
        )
        tmp.replace(args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
