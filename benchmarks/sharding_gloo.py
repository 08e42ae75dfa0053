"""Sharding benchmark on CPU/gloo: step time and exchanged bytes per mode and world size.

For every world size W it starts W gloo processes (tests/distributed/harness.py, one torch
thread each) and, for every sharding mode, builds the model exactly as training does
(hybridrec.train.trainer.Trainer on a validated Hydra config), attaches a CommStats to the
sharded embedding collection and times `Trainer.train_step` (forward, backward with the
in-backward sparse update, dense optimizer step) on distinct synthetic global batches.

Step time: before every step all ranks meet at a barrier; a step's time is the slowest rank's,
and the table shows the median over the timed steps. samples/s = global batch / step time.

Bytes: CommStats counts what each named exchange sends to and receives from *other* ranks.
Per rank and per step they are held against the planner's cost model for the same plan
(hybridrec.planner.estimate_cost), grouped by name: ids (input_dist*, dp_ids), pooled
embeddings (output_dist), their gradients (output_dist.backward, the mirror of output_dist)
and the replicated tables' gradient sync (dp_grads*). Any other name (row_stats) is counted
in the totals and listed as not modelled. Row-wise id traffic depends on the data (the model
assumes uniform ids), so only it may differ. Not in CommStats: DDP's all-reduce of the dense
gradients, the id-range check's one-int all-reduce, the barrier.

Baselines, measured in the same run, single process, one thread:
- plain PyTorch: one nn.EmbeddingBag(sparse=True) per table with torch.optim.SGD (SparseAdam /
  Adagrad for --optimizer adam / rowwise_adagrad), and the same dense part (DenseArch) and
  dense optimizer as hybridrec, on the same batches;
- reference: hybridrec with sharding=none (the single-process model the sharded runs equal).

    python -m benchmarks.sharding_gloo --out benchmarks/results/sharding_gloo.md
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.baseline import PlainDLRM, plain_sparse_optimizer
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
    time_steps,
)
from hybridrec.config import Config
from hybridrec.data import build_source
from hybridrec.distributed import DistEnv
from hybridrec.distributed.comm import CommStats
from hybridrec.model import DenseArch, bce_loss
from hybridrec.optim import build_dense_optimizer
from hybridrec.planner import OptimizerFootprint, Topology, estimate_cost
from hybridrec.train.trainer import Trainer
from hybridrec.types import ShardingPlan, ShardingType
from tests.distributed.harness import spawn

MODES = ("table_wise", "column_wise", "row_wise", "data_parallel", "auto")
SPARSE_LR = {"sgd": 0.05, "rowwise_adagrad": 0.05, "adam": 0.001, "adagrad": 0.05}
# "mid": 8 tables from 1e3 to 1e6 rows (2.44M rows x 32 = 312 MB of fp32 weights), one id
# per table and sample, so every mode moves real bytes and the big tables dominate.
MODELS = {
    "mid": [
        "model.name=mid",
        "model.embedding_dim=32",
        "model.num_embeddings_per_feature=[1000,3000,10000,30000,100000,300000,1000000,1000000]",
        "model.hotness=1",
        "model.bottom_mlp=[64,32]",
        "model.top_mlp=[128,64,1]",
    ],
}
ABBREV = {
    ShardingType.TABLE_WISE: "TW",
    ShardingType.COLUMN_WISE: "CW",
    ShardingType.ROW_WISE: "RW",
    ShardingType.DATA_PARALLEL: "DP",
}


# -- configs ---------------------------------------------------------------------------------
def make_cfg(args: argparse.Namespace, mode: str, world: int) -> Config:
    """The validated training config for one (mode, world size), composed like the tests do."""
    if args.model in MODELS:
        model = ["model=dlrm_tiny", *MODELS[args.model]]
    else:
        model = [f"model={args.model}"]
    overrides = [
        *model,
        f"sharding={mode}",
        "device=cpu",
        f"seed={args.seed}",
        f"train.batch_size={args.batch_size}",
        f"eval.batch_size={args.batch_size}",  # unused; must split over the ranks too
        f"optim.sparse.name={args.optimizer}",
        f"optim.sparse.lr={SPARSE_LR[args.optimizer]}",
        "logger=none",
        *args.override,
    ]
    return compose_config(overrides, world_size=world)


def plan_summary(plan: ShardingPlan | None) -> str:
    """'2 DP + 5 TW + 1 CW (2)': tables per sharding type, shards in parentheses if split."""
    if plan is None:
        return "-"
    tables: dict[ShardingType, int] = {}
    shards: dict[ShardingType, int] = {}
    for tp in plan.tables:
        tables[tp.sharding] = tables.get(tp.sharding, 0) + 1
        shards[tp.sharding] = shards.get(tp.sharding, 0) + len(tp.shards)
    parts = []
    for kind in ShardingType:
        if kind in tables:
            split = kind in (ShardingType.COLUMN_WISE, ShardingType.ROW_WISE)
            extra = f" ({shards[kind]} shards)" if split else ""
            parts.append(f"{tables[kind]} {ABBREV[kind]}{extra}")
    return " + ".join(parts)


# -- one rank ------------------------------------------------------------------------------
def measure(env: DistEnv, cfg: Config, steps: int, warmup: int) -> dict:
    """Time Trainer.train_step on this rank; count bytes per exchange over the timed steps."""
    trainer = Trainer(cfg, env)
    stats = CommStats()
    emb = trainer.embeddings[0]
    emb.stats = stats  # Trainer builds the model without one; builder.build(cfg, env, stats)
    batches = [trainer.train_batch(s) for s in range(warmup + steps)]
    barrier = (lambda: dist.barrier(group=env.group)) if env.group is not None else None
    losses: list[torch.Tensor] = []

    def step(i: int) -> None:
        losses.append(trainer.train_step(batches[i]))

    time_steps(step, 0, warmup, barrier)
    stats.reset()
    times = time_steps(lambda i: step(warmup + i), steps, 0, barrier)
    loss = trainer.global_mean(losses[-1])
    result = {
        "times": times,
        "sent": {k: v / steps for k, v in stats.sent.items()},
        "recv": {k: v / steps for k, v in stats.recv.items()},
        "plan": trainer.plan,
        "loss": loss,
    }
    return result


def run_rank(env: DistEnv, jobs: list[tuple[str, Config]], steps: int, warmup: int) -> dict:
    out = {}
    for mode, cfg in jobs:
        out[mode] = measure(env, cfg, steps, warmup)
        gc.collect()  # free this mode's tables before the next one is built
    return out


# -- the plain PyTorch baseline ------------------------------------------------------------
def measure_plain(cfg: Config, steps: int, warmup: int) -> dict:
    model = PlainDLRM(cfg)
    dense_opt = build_dense_optimizer(
        model.dense.parameters(), cfg.optim.dense, torch.device("cpu")
    )
    sparse_opt = plain_sparse_optimizer(list(model.bags.parameters()), cfg)
    source = build_source(cfg)  # the trainer's data source
    batches = [source.batch(s, cfg.train.batch_size) for s in range(warmup + steps)]

    losses: list[torch.Tensor] = []

    def step(i: int) -> None:
        b = batches[i]
        loss = bce_loss(model(b.dense, b.ids), b.labels)
        losses.append(loss.detach())
        dense_opt.zero_grad(set_to_none=True)
        sparse_opt.zero_grad(set_to_none=True)
        loss.backward()
        dense_opt.step()
        sparse_opt.step()

    times = time_steps(step, steps, warmup)
    return {"times": times, "loss": float(losses[-1])}


def measure_reference(cfg: Config, steps: int, warmup: int) -> dict:
    return measure(DistEnv(), cfg, steps, warmup)


# -- comparison with the cost model --------------------------------------------------------
def _kind(name: str) -> str:
    """Which cost-model figure an exchange's bytes belong to ('' = not in the model)."""
    if name.startswith("input_dist") or name == "dp_ids":
        return "ids"
    if name == "output_dist":
        return "emb"
    if name == "output_dist.backward":
        return "emb grad"
    if name.startswith("dp_grads"):
        return "dp grad"
    return ""


def model_check(cfg: Config, plan: ShardingPlan, ranks: list[dict]) -> dict:
    """Measured vs predicted bytes per rank; returns totals (all ranks) and a verdict."""
    world = plan.world_size
    cost = estimate_cost(
        plan,
        cfg.model.tables(),
        Topology(world, int(cfg.sharding.hbm_gb * 2**30)),
        cfg.train.batch_size,
        OptimizerFootprint.for_optimizer(cfg.optim.sparse.name),
    )
    worst: tuple[float, str] = (0.0, "")
    measured_total = predicted_total = 0.0
    unmodelled: set[str] = set()
    for r, (res, rc) in enumerate(zip(ranks, cost.ranks, strict=True)):
        got: dict[str, float] = {}
        for direction in ("sent", "recv"):
            for name, nbytes in res[direction].items():
                kind = _kind(name)
                if not kind:
                    unmodelled.add(name)
                    kind = "other"
                key = f"{kind} {direction}"
                got[key] = got.get(key, 0.0) + nbytes
        predicted = {
            "ids sent": rc.ids_sent_bytes,
            "ids recv": rc.ids_recv_bytes,
            "emb sent": rc.emb_sent_bytes,
            "emb recv": rc.emb_recv_bytes,
            "emb grad sent": rc.emb_recv_bytes,  # the backward mirrors the output dist
            "emb grad recv": rc.emb_sent_bytes,
            "dp grad sent": rc.dp_grad_sent_bytes,
            "dp grad recv": rc.dp_grad_recv_bytes,
        }
        for what, p in predicted.items():
            m = got.get(what, 0.0)
            if abs(m - p) >= 0.5:  # equal to the byte (float sums: the all-reduce's 2(W-1)/W)
                dev = abs(m - p) / p if p else float("inf")
                if dev > worst[0] or not worst[1]:
                    worst = (dev, f"{what} {100 * (m - p) / p:+.1f}% (rank {r})" if p else what)
        measured_total += sum(v for k, v in got.items() if k.endswith("sent"))
        predicted_total += sum(p for k, p in predicted.items() if k.endswith("sent"))
    verdict = "exact" if not worst[1] else f"max dev: {worst[1]}"
    if unmodelled:
        verdict += f"; not modelled: {', '.join(sorted(unmodelled))}"
    return {"measured": measured_total, "predicted": predicted_total, "verdict": verdict}


def exchange_names(measured: list) -> list[str]:
    """Every exchange name seen, in protocol order (forward, backward), unknown ones last."""
    order = ["input_dist.counts", "input_dist", "dp_ids", "output_dist", "output_dist.backward"]
    seen = {n for *_, ranks, _ in measured for r in ranks for n in r["sent"]}
    return sorted(seen, key=lambda n: (order.index(n) if n in order else len(order), n))


def kib(x: float) -> str:
    return f"{x / 1024:,.1f}"


# -- main ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(
            "Step time and exchanged bytes per sharding mode and world size on CPU/gloo, "
            "against a plain PyTorch DLRM and the single-process reference in the same run."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="mid",
        help="'mid' (8 tables, 1e3..1e6 rows, dim 32) or a conf/model name, e.g. dlrm_tiny",
    )
    p.add_argument("--world-sizes", default="1,2,3,4", help="comma-separated world sizes")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated sharding modes")
    p.add_argument("--batch-size", type=int, default=4092, help="global batch (split over ranks)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    p.add_argument(
        "--optimizer",
        default="sgd",
        choices=sorted(SPARSE_LR),
        help="sparse (embedding) optimizer; the plain baseline uses torch's closest",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Hydra override for every config (repeatable)",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per world size")
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    args.world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {bad}; choose from {', '.join(MODES)}")
    for w in args.world_sizes:
        if w < 1 or args.batch_size % w:
            p.error(f"--batch-size {args.batch_size} must split evenly over {w} ranks")
    return args


def baselines(cfg: Config, steps: int, warmup: int) -> tuple[dict, dict]:
    """The plain PyTorch DLRM's and the sharding=none reference's results (this process)."""
    plain_res = measure_plain(cfg, steps, warmup)
    gc.collect()
    ref_res = measure_reference(cfg, steps, warmup)
    gc.collect()
    plain, ref = plain_res["times"], ref_res["times"]
    print(
        f"plain PyTorch {median(plain) * 1e3:.1f} ms/step, "
        f"reference (sharding=none) {median(ref) * 1e3:.1f} ms/step",
        flush=True,
    )
    return plain_res, ref_res


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # like every rank: one thread per process
    host, code = hardware(), git_state()
    load = [load_average()]
    busy_0, own_0, wall_0 = *cpu_seconds(), time.perf_counter()
    print(f"# {host}; load average {load[0]}", flush=True)
    ref_cfg = make_cfg(args, "none", 1)
    batch = args.batch_size

    # Baselines before and after the sharded runs: the spread shows how steady the host was,
    # and the ratios use all their timed steps together.
    plain_0, ref_0 = baselines(ref_cfg, args.steps, args.warmup)
    ref_loss, plain_loss = ref_0["loss"], plain_0["loss"]
    measured = []
    for world in args.world_sizes:
        jobs = [(mode, make_cfg(args, mode, world)) for mode in args.modes]
        results = spawn(world, run_rank, jobs, args.steps, args.warmup, timeout=args.timeout)
        for mode, cfg in jobs:
            ranks = [r[mode] for r in results]
            per_step = [max(ts) for ts in zip(*(r["times"] for r in ranks), strict=True)]
            measured.append((world, mode, cfg, ranks, median(per_step)))
            print(f"W={world} {mode}: {median(per_step) * 1e3:.1f} ms/step", flush=True)
    plain_1, ref_1 = baselines(ref_cfg, args.steps, args.warmup)
    load.append(load_average())
    busy_1, own_1, wall_1 = *cpu_seconds(), time.perf_counter()
    wall = wall_1 - wall_0
    others = max(0.0, (busy_1 - busy_0) - (own_1 - own_0))
    load.append(
        f"other processes used {others:.0f} CPU-seconds during the {wall:.0f} s run "
        f"({100 * others / (wall * host_cores()):.0f}% of the host's cores)"
    )
    plain_0, plain_1 = plain_0["times"], plain_1["times"]
    ref_0, ref_1 = ref_0["times"], ref_1["times"]
    plain, ref = median(plain_0 + plain_1), median(ref_0 + ref_1)
    spread = (
        f"plain PyTorch {median(plain_0) * 1e3:.1f} ms/step before the sharded runs, "
        f"{median(plain_1) * 1e3:.1f} after; reference {median(ref_0) * 1e3:.1f} before, "
        f"{median(ref_1) * 1e3:.1f} after"
    )

    def speed(label: str, w: object, plan: str, t: float, loss: float) -> list[object]:
        return [
            w,
            label,
            plan,
            f"{loss:.6f}",
            f"{t * 1e3:.1f}",
            f"{batch / t:,.0f}",
            f"{plain / t:.2f}",
            f"{ref / t:.2f}",
        ]

    rows = [
        speed("plain PyTorch (EmbeddingBag + torch.optim)", 1, "-", plain, plain_loss)
        + ["-", "-", "-"],
        speed("reference (sharding=none)", 1, "-", ref, ref_loss) + ["-", "-", "-"],
    ]
    byte_rows = []
    names = exchange_names(measured)
    for world, mode, cfg, ranks, t in measured:
        plan = ranks[0]["plan"]
        check = model_check(cfg, plan, ranks)
        loss = ranks[0]["loss"]
        if abs(loss - ref_loss) > 1e-4 * abs(ref_loss):  # the equivalence principle, as a guard
            print(f"WARNING: W={world} {mode} loss {loss} != reference {ref_loss}", flush=True)
        rows.append(
            speed(mode, world, plan_summary(plan), t, loss)
            + [kib(check["measured"]), kib(check["predicted"]), check["verdict"]]
        )
        byte_rows.append(
            [world, mode] + [f"{sum(r['sent'].get(n, 0.0) for r in ranks):,.0f}" for n in names]
        )

    headers = [
        "W",
        "mode",
        "plan",
        f"loss @ step {args.warmup + args.steps}",
        "step ms",
        "samples/s",
        "vs plain",
        "vs reference",
        "sent KiB/step (measured)",
        "sent KiB/step (cost model)",
        "bytes vs cost model (per rank)",
    ]
    table = markdown_table(headers, rows)
    bytes_table = markdown_table(["W", "mode", *names], byte_rows)
    print()
    print(table)
    print()
    print(bytes_table)
    print(f"\n{spread}; load average {load[0]} at start, {load[1]} at end; {load[2]}")
    if args.out is not None:
        write_report(args, host, code, ref_cfg, table, bytes_table, spread, load)


def write_report(
    args: argparse.Namespace,
    host: str,
    code: str,
    cfg: Config,
    table: str,
    bytes_table: str,
    spread: str,
    load: list[str],
) -> None:
    m = cfg.model
    dense_params = sum(p.numel() for p in DenseArch(m).parameters())
    cores = host_cores()
    over = [w for w in args.world_sizes if w > cores]
    note = (
        f"- **Oversubscribed**: this machine has {cores} cores, so world sizes {over} run more\n"
        "  processes than cores; their step times measure contention as much as the exchange.\n"
        "  No multi-rank row here is a scaling result.\n"
        if over
        else ""
    )
    text = f"""# Sharding benchmark on CPU/gloo

Command (from the repository root):

```bash
{command_line()}
```

- Hardware: {host}.
- Code: git {code} (at the start of the run).
- Host load: {load[2]}. Load average (1, 5, 15 min): {load[0]} before the run, {load[1]} at
  its end (this benchmark included). Other processes share this host; while they are busy,
  step times are slower and noisier than the machine allows.
- Model `{args.model}`: {len(m.num_embeddings_per_feature)} tables, rows
  {m.num_embeddings_per_feature}, dim {m.embedding_dim}, hotness {m.hotness}, {m.pooling}
  pooling; bottom MLP {m.bottom_mlp}, top MLP {m.top_mlp} ({dense_params:,} dense parameters);
  synthetic Zipf-like data.
- Global batch {args.batch_size}; sparse optimizer `{cfg.optim.sparse.name}` (lr
  {cfg.optim.sparse.lr}), dense optimizer `{cfg.optim.dense.name}`.
- Timing: {args.warmup} warmup steps, then the median of {args.steps} timed steps of
  `Trainer.train_step` (forward, backward with the in-backward sparse update, dense optimizer
  step). All ranks meet at a barrier before each step; a step's time is its slowest rank's.
  One torch thread per process, gloo over loopback. W=1 rows run the sharded code path on a
  one-rank gloo group.

Columns:

- **loss @ step N**: global mean loss of the last timed step. Every sharded row equals the
  reference (the equivalence principle), so every row trained the same model; the plain
  baseline has its own initialisation.
- **vs plain**: samples/s relative to the plain PyTorch DLRM (one `nn.EmbeddingBag(sparse=True)`
  per table, `torch.optim` sparse optimizer, the same dense part and dense optimizer), single
  process, one thread, on the same batches. **vs reference**: relative to hybridrec with
  `sharding=none`. Both baselines ran before and after the sharded runs; their rows are the
  median over both:
  {spread}.
- **sent KiB/step**: bytes sent to other ranks per step, summed over ranks and exchanges
  (CommStats, every exchange named in the second table). The cost model is
  `hybridrec.planner.estimate_cost` for the same plan.
- **bytes vs cost model**: every rank's ids (`input_dist*`, `dp_ids`), pooled embeddings
  (`output_dist`), their gradients (`output_dist.backward`) and replicated tables' gradient
  sync (`dp_grads*`), sent and received, against the model: `exact` = every figure matched to
  the byte, otherwise the largest deviation. Row-wise id traffic depends on the data (the
  model assumes ids uniform over the rows), so only row-wise rows may differ. Collectives
  other than all-to-all (all-gather, all-reduce) are counted by CommStats with a formula
  (all-reduce: a ring's 2(W-1)/W x bytes), not read off the wire.
- Not counted anywhere: DDP's all-reduce of the dense gradients ({4 * dense_params:,} bytes
  of fp32 gradients per rank per step), the id-range check's one-int all-reduce, the barrier.
{note}
{table}

Bytes sent to other ranks per step, per exchange, summed over ranks (measured):

{bytes_table}
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
