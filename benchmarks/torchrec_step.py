"""hybridrec vs TorchRec on CPU/gloo: the whole training step, side by side in the same processes.

What is timed is the whole training step (forward, backward with the sparse update, dense
optimizer step), of three systems built on every rank of W gloo processes (one torch thread
each), for each sharding mode:
- hybridrec: `Trainer` on a validated Hydra config (what `hybridrec-train` runs, defaults
  included: id checks on), timed through `Trainer.train_step`;
- TorchRec's own DLRM (torchrec.models.dlrm.DLRM, MLP weights copied from hybridrec's);
- TorchRec's EmbeddingBagCollection under a copy of hybridrec's dense part (same weights):
  both embedding sides under one dense part, so this pair differs in the embedding side alone.
Both TorchRec systems hold the same tables and initial rows (hybridrec.sparse.init.init_shard
of each whole table), sharded by `DistributedModelParallel` with the same plan (table-, row- or
column-wise; one rank: all tables table-wise on it), on FBGEMM's fused CPU kernels with the
optimizer applied in the backward (`apply_optimizer_in_backward`: SGD or row-wise Adagrad,
the latter not column-wise: there TorchRec's shards keep their own row statistics, a
different optimizer from one table's);
their dense parts run under DDP with the same dense optimizer. W=1 also runs plain PyTorch
(benchmarks.baseline.PlainDLRM: nn.EmbeddingBag(sparse=True) + torch.optim).

Gradient scaling: each rank's loss is the mean over its B/W samples. hybridrec multiplies the
embedding gradients by 1/W where they leave its model (hybridrec/shard.py); TorchRec does the
same in its output dist's backward (torchrec.distributed.comm_ops.get_gradient_division(), on
by default). So no scaling is added to TorchRec's side; only were its division switched off
would ScaleGrad(1/W) stand in for it. Scaling twice trains TorchRec on half its gradient.

Parity, checked before any time is reported: the systems start from the same weights and see
the same batches, so their losses agree to float32 round-off. The largest loss difference
from hybridrec's over the first 10 steps (any rank) is printed per system and mode, and above
1e-6 the benchmark stops with exit code 1 and one line naming the mode, the system, the step
and the gap (a wrong gradient scale gives 3e-6 at 2 ranks within 10 steps). Round-off grows
from step to step at this learning rate, so the largest gap over the whole run is printed too.

Timing: on every step the systems run one after another on the same batch, each after a
barrier, in alternating order (hybridrec first on even steps, last on odd ones), so none
always runs first or after the same neighbour; a step's time is the slowest rank's. The ratio
is paired: the median over steps of (their step / hybridrec's step in the same step), with its
quartiles (> 1: hybridrec faster). On a shared machine, a burst of load hits both sides of a
pair alike; the report names the CPU, its cores and the load averages before and after.

TorchRec is not a dependency of hybridrec. Install it beside hybridrec in its own venv
(TorchRec 1.8 with fbgemm-gpu-cpu 1.8 runs on torch 2.13's CPU wheel; fbgemm-gpu-cpu must come
without its CUDA twin, which torchrec's requirements pull in):

    python3 -m venv /tmp/trvenv
    /tmp/trvenv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /tmp/trvenv/bin/pip install torchrec==1.8.0 && /tmp/trvenv/bin/pip uninstall -y fbgemm-gpu
    /tmp/trvenv/bin/pip install --no-deps fbgemm-gpu-cpu==1.8.0 && /tmp/trvenv/bin/pip install -e .
    OMP_NUM_THREADS=1 /tmp/trvenv/bin/python -m benchmarks.torchrec_step \\
        --out benchmarks/results/torchrec_step_cpu.md

TorchRec's planner offers row-wise only for CUDA; the plan here is built with its own
`construct_module_sharding_plan` and a sharder that also lists row-wise for the CPU, where
FBGEMM's CPU kernels run it.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.baseline import PlainDLRM, plain_sparse_optimizer
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
from benchmarks.sharding_gloo import MODELS, SPARSE_LR, make_cfg
from hybridrec.config import Config
from hybridrec.distributed import DistEnv
from hybridrec.distributed.comm import ScaleGrad
from hybridrec.model import DenseArch, bce_loss
from hybridrec.optim import build_dense_optimizer
from hybridrec.sparse.init import init_shard
from hybridrec.sparse.layout import full_shard
from hybridrec.train.checkpoint.format import dense_module, dense_state
from hybridrec.train.trainer import Trainer
from tests.distributed.harness import spawn

MODES = ("table_wise", "row_wise", "column_wise")
CONF_MODELS = Path(__file__).resolve().parents[1] / "conf" / "model"
OPTIMIZERS = ("sgd", "rowwise_adagrad")


def _torchrec_available() -> str | None:
    """None when torchrec and fbgemm_gpu import, else why not."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except Exception as e:  # noqa: BLE001 (an ImportError, or fbgemm's OSError on a bad wheel)
        return f"{type(e).__name__}: {e}"
    return None


def _kjt(ids: torch.Tensor, keys: list[str]):  # noqa: ANN202
    """ids [B_l, T] (hotness 1) as TorchRec's KeyedJaggedTensor (key-major values)."""
    from torchrec import KeyedJaggedTensor

    b, t = ids.shape
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=ids.t().reshape(-1), lengths=torch.ones(b * t, dtype=torch.int64)
    )


def torchrec_scale(world: int) -> float | None:
    """The factor TorchRec's pooled embeddings' gradients still need to be hybridrec's, or
    None: TorchRec's output dist divides them by W in its backward unless its gradient
    division is off (torchrec.distributed.comm_ops.get_gradient_division), and then 1/W is
    missing; hybridrec's model divides by W once (hybridrec/shard.py)."""
    from torchrec.distributed.comm_ops import get_gradient_division

    return None if world == 1 or get_gradient_division() else 1.0 / world


class EbcWithHybridrecDense(nn.Module):
    """TorchRec's sharded EmbeddingBagCollection under hybridrec's dense part: the embedding
    side alone differs from hybridrec's model."""

    def __init__(self, ebc: nn.Module, dense: nn.Module, keys: list[str], world: int) -> None:
        super().__init__()
        self.ebc, self.dense, self.keys = ebc, dense, keys
        self.scale = torchrec_scale(world)

    def pooled(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B_l, T] -> pooled [B_l, T, D] in table order."""
        b, t = ids.shape
        out = self.ebc(_kjt(ids, self.keys))  # a KeyedTensor, its keys in the sharding's order
        if out.keys() == self.keys:
            return out.values().view(b, t, -1)
        per_key = out.to_dict()  # as TorchRec's DLRM does (SparseArch cats its to_dict())
        return torch.stack([per_key[k] for k in self.keys], dim=1)

    def forward(self, dense_x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pooled = self.pooled(ids)
        if self.scale is not None:
            pooled = ScaleGrad.apply(pooled, self.scale)
        return self.dense(dense_x, pooled)


def _linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def _copy_dense(src: DenseArch, dlrm: nn.Module, num_tables: int) -> None:
    """hybridrec's MLP weights into TorchRec's DLRM. Its interaction lists the pairs of the
    upper triangle (i < j) where hybridrec lists the lower one (i > j): the top MLP's first
    layer gets its pair columns permuted to match, so both compute the same function."""
    bottom, top = _linears(src.bottom), _linears(src.top)
    theirs_bottom, theirs_top = _linears(dlrm.dense_arch), _linears(dlrm.over_arch)
    if len(bottom) != len(theirs_bottom) or len(top) != len(theirs_top):
        raise RuntimeError("TorchRec's DLRM has other layers than hybridrec's")
    f = num_tables + 1
    lower = {(int(i), int(j)): k for k, (i, j) in enumerate(torch.tril_indices(f, f, -1).t())}
    upper = torch.triu_indices(f, f, 1).t()
    d = bottom[-1].out_features  # the bottom output, first in both
    cols = list(range(d)) + [d + lower[(int(j), int(i))] for i, j in upper]
    with torch.no_grad():
        for mine, theirs in zip(bottom + top, theirs_bottom + theirs_top, strict=True):
            theirs.weight.copy_(mine.weight)
            theirs.bias.copy_(mine.bias)
        theirs_top[0].weight.copy_(top[0].weight[:, cols])


class TorchRecSystems:
    """TorchRec's step on this rank, twice: its own DLRM (torchrec.models.dlrm.DLRM, weights
    copied from hybridrec's) and its EmbeddingBagCollection under hybridrec's dense part;
    both on FBGEMM's fused CPU kernels with the same plan and hybridrec's initial rows."""

    def __init__(self, env: DistEnv, cfg: Config, trainer: Trainer, mode: str) -> None:
        from torchrec.models.dlrm import DLRM
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        self.tables = cfg.model.tables()
        self.keys = [f"f{i}" for i in range(len(self.tables))]
        self.env, self.cfg, self.mode = env, cfg, mode
        source = dense_module(trainer.model)  # DLRM: the dense arch and its tables
        world = env.world_size

        # TorchRec's DLRM; its output dist divides the pooled gradients by W (torchrec_scale)
        m = cfg.model
        dlrm = DLRM(self._ebc(), m.num_dense_features, list(m.bottom_mlp), list(m.top_mlp))
        _copy_dense(source, dlrm, len(self.tables))
        self.dlrm = self._shard(dlrm, "sparse_arch.embedding_bag_collection")
        scale = torchrec_scale(world)
        if scale is not None:
            sparse_arch = self.dlrm.module.sparse_arch
            sparse_arch.register_forward_hook(lambda mod, i, o: ScaleGrad.apply(o, scale))
        params = dict(in_backward_optimizer_filter(self.dlrm.named_parameters()))
        self.dlrm_opt = build_dense_optimizer(params.values(), cfg.optim.dense, env.device)

        # TorchRec's EmbeddingBagCollection under a copy of hybridrec's dense part
        dense = DenseArch(cfg.model)
        dense.load_state_dict(dense_state(trainer.model))
        if world > 1:
            dense = nn.parallel.DistributedDataParallel(dense, broadcast_buffers=False)
        self.ebc = EbcWithHybridrecDense(self._shard(self._ebc(), ""), dense, self.keys, world)
        self.ebc_opt = build_dense_optimizer(dense.parameters(), cfg.optim.dense, env.device)

    def _ebc(self) -> nn.Module:
        """The tables as TorchRec's EmbeddingBagCollection, the optimizer in its backward."""
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.optim import RowWiseAdagrad
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        configs = [
            EmbeddingBagConfig(
                name=f"t{i}", embedding_dim=t.dim, num_embeddings=t.num_rows, feature_names=[k]
            )
            for i, (t, k) in enumerate(zip(self.tables, self.keys, strict=True))
        ]
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        s = self.cfg.optim.sparse
        if s.name == "sgd":
            apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": s.lr})
        else:
            opt_args = {"lr": s.lr, "eps": s.eps}
            apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), opt_args)
        return ebc

    def _shard(self, model: nn.Module, path: str) -> nn.Module:
        """DistributedModelParallel over `model`, whose EmbeddingBagCollection is at `path`,
        with this mode's plan; then hybridrec's initial rows into its shards."""
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.sharding_plan import (
            column_wise,
            construct_module_sharding_plan,
            row_wise,
            table_wise,
        )
        from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType

        class CpuShardingTypes(EmbeddingBagCollectionSharder):
            """FBGEMM's CPU kernels run row-wise too; TorchRec's planner offers it on CUDA only."""

            def sharding_types(self, compute_device_type: str) -> list[str]:
                kinds = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)
                return [k.value for k in kinds]

        world, n = self.env.world_size, len(self.tables)
        if world == 1 or self.mode == "table_wise":
            per_table = {f"t{i}": table_wise(rank=i % world) for i in range(n)}
        elif self.mode == "row_wise":
            per_table = {f"t{i}": row_wise() for i in range(n)}
        else:
            per_table = {f"t{i}": column_wise(ranks=list(range(world))) for i in range(n)}
        sharder = CpuShardingTypes()
        ebc = model.get_submodule(path) if path else model
        module_plan = construct_module_sharding_plan(
            ebc, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
        )
        group = self.env.group if self.env.group is not None else dist.GroupMember.WORLD
        sharded = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(group),
            device=torch.device("cpu"),
            plan=ShardingPlan({path: module_plan}),
            sharders=[sharder],
        )
        _copy_rows(
            sharded.module.get_submodule(path) if path else sharded.module,
            self.tables,
            self.cfg.seed,
        )
        return sharded

    def dlrm_step(self, b) -> torch.Tensor:  # noqa: ANN001
        loss = bce_loss(self.dlrm(b.dense, _kjt(b.ids, self.keys)).squeeze(1), b.labels)
        self.dlrm_opt.zero_grad(set_to_none=True)
        loss.backward()  # FBGEMM updates the rows in here
        self.dlrm_opt.step()
        return loss.detach()

    def ebc_step(self, b) -> torch.Tensor:  # noqa: ANN001
        loss = bce_loss(self.ebc(b.dense, b.ids), b.labels)
        self.ebc_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.ebc_opt.step()
        return loss.detach()


def _copy_rows(sharded_ebc: nn.Module, tables: list, seed: int) -> None:
    """hybridrec's initial rows into every FBGEMM table shard this rank holds, through the
    kernels' own weight views (split_embedding_weights; the lookups are not registered
    submodules, so the module tree does not reach them)."""
    full: dict[str, torch.Tensor] = {}
    copied = 0
    kernels = [k for lookup in sharded_ebc._lookups for k in lookup._emb_modules]
    with torch.no_grad():
        for module in kernels:
            weights = module.split_embedding_weights()
            for spec, weight in zip(module._config.embedding_tables, weights, strict=True):
                i = int(spec.name[1:])
                if spec.name not in full:
                    t = tables[i]
                    full[spec.name] = init_shard(t, i, full_shard(t), seed, torch.float32)
                (r, c), (h, w) = spec.local_metadata.shard_offsets, spec.local_metadata.shard_sizes
                weight.copy_(full[spec.name][r : r + h, c : c + w])
                copied += 1
    if not copied:
        raise RuntimeError("found no FBGEMM table to copy hybridrec's rows into")


def _plain(cfg: Config, trainer: Trainer, env: DistEnv):  # noqa: ANN202
    """Plain PyTorch's step (one process), from hybridrec's initial weights."""
    model = PlainDLRM(cfg)
    model.dense.load_state_dict(dense_state(trainer.model), strict=False)
    with torch.no_grad():
        for i, (t, bag) in enumerate(zip(cfg.model.tables(), model.bags, strict=True)):
            init_shard(t, i, full_shard(t), cfg.seed, torch.float32, out=bag.weight.data)
    opts = [
        build_dense_optimizer(model.dense.parameters(), cfg.optim.dense, env.device),
        plain_sparse_optimizer(list(model.bags.parameters()), cfg),
    ]

    def step(b) -> torch.Tensor:  # noqa: ANN001
        loss = bce_loss(model(b.dense, b.ids), b.labels)
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts:
            o.step()
        return loss.detach()

    return step


SYSTEMS = ("hybridrec", "torchrec", "torchrec_ebc", "plain")
NAMES = {
    "hybridrec": "hybridrec",
    "torchrec": "TorchRec DLRM",
    "torchrec_ebc": "TorchRec EBC + our dense",
    "plain": "plain",
}


def run_rank(
    env: DistEnv, jobs: list[tuple[str, Config]], steps: int, warmup: int, heap: str = "held"
) -> dict:
    """Per mode: this rank's step times and losses of each system, interleaved in alternating
    order (step_order), every step on the same batch after a barrier; `heap`: --heap's."""
    use_heap(heap)
    out = {}
    barrier = (lambda: dist.barrier(group=env.group)) if env.group is not None else None
    for mode, cfg in jobs:
        trainer = Trainer(cfg, env)
        theirs = TorchRecSystems(env, cfg, trainer, mode)
        batches = [trainer.train_batch(s) for s in range(warmup + steps)]
        systems = {
            "hybridrec": trainer.train_step,
            "torchrec": theirs.dlrm_step,
            "torchrec_ebc": theirs.ebc_step,
        }
        if env.world_size == 1 and cfg.optim.sparse.name == "sgd":  # no plain row-wise Adagrad
            systems["plain"] = _plain(cfg, trainer, env)
        times: dict[str, list[float]] = {k: [] for k in systems}
        losses: dict[str, list[float]] = {k: [] for k in systems}
        for i, b in enumerate(batches):
            for name in step_order(list(systems), i):
                if barrier is not None:
                    barrier()
                t0 = time.perf_counter()
                loss = systems[name](b)
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
                losses[name].append(float(loss))
        out[mode] = {"times": times, "losses": losses}
        del trainer, theirs, systems
        gc.collect()
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="hybridrec vs TorchRec (FBGEMM CPU) training steps on CPU/gloo, interleaved "
        "in the same processes",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes")
    p.add_argument("--modes", default=",".join(MODES), help="sharding modes for W > 1")
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    p.add_argument(
        "--model",
        default="mid",
        help="'mid' (8 tables, 1e3..1e6 rows, dim 32) or a conf/model name (dlrm_tiny)",
    )
    p.add_argument("--batch-size", type=int, default=4096, help="global batch")
    p.add_argument("--steps", type=int, default=30, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--timeout", type=float, default=900, help="seconds per world size")
    heap_option(p)
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    args.world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    args.modes = [m for m in args.modes.split(",") if m]
    if set(args.modes) - set(MODES):
        p.error(f"--modes takes {', '.join(MODES)}")
    if args.model not in MODELS and not (CONF_MODELS / f"{args.model}.yaml").is_file():
        p.error(f"--model takes {', '.join(MODELS)} or a name under {CONF_MODELS}")
    if args.optimizer == "rowwise_adagrad" and "column_wise" in args.modes:
        p.error(
            "--optimizer rowwise_adagrad with column_wise compares two optimizers: TorchRec's "
            "column shards each keep their own row statistic (mean g^2 over the shard's "
            "columns), hybridrec's the full row's, as one table would: pass --modes "
            "table_wise,row_wise"
        )
    if args.warmup + args.steps < PARITY_STEPS:
        p.error(f"--warmup + --steps must be at least {PARITY_STEPS}: the parity check's steps")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def summarise(world: int, mode: str, per_rank: list[dict]) -> tuple[list, list[str], str]:
    """(the report's row, parity failures, the parity line) of one (world size, mode)."""
    ours = slowest([r["times"]["hybridrec"] for r in per_rank])
    cells, ratios = [], []
    for k in SYSTEMS:
        if k not in per_rank[0]["times"]:
            cells.append("-")
            ratios += ["-"] if k != "hybridrec" else []
            continue
        theirs = slowest([r["times"][k] for r in per_rank])
        cells.append(f"{1e3 * median(theirs):.2f}")
        if k != "hybridrec":
            mid, q1, q3 = paired_ratio(theirs, ours)
            ratios.append(f"{mid:.2f} ({q1:.2f}-{q3:.2f})")
    losses = [r["losses"] for r in per_rank]
    first = loss_gaps(losses, "hybridrec", PARITY_STEPS)
    whole = loss_gaps(losses, "hybridrec", None)
    label = f"W={world} {'one process' if world == 1 else mode}"
    failures = parity_failures(label, first, NAMES, "hybridrec")
    gaps = ", ".join(
        f"{NAMES[k]} {first[k][0]:.0e} / {whole[k][0]:.0e}" for k in SYSTEMS if k in first
    )
    parity = f"{label}: loss gap to hybridrec, first {PARITY_STEPS} / all steps: {gaps}"
    row = [world, "one process" if world == 1 else mode, *cells, *ratios]
    row += [f"{losses[0]['hybridrec'][-1]:.6f}", gaps]
    return row, failures, parity


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = _torchrec_available()
    if why is not None:
        print(
            f"torchrec_step: TorchRec is not importable here ({why}); see this script's "
            "docstring for a venv that has it",
            file=sys.stderr,
        )
        return 2
    import torchrec

    torch.set_num_threads(1)
    args.lr = SPARSE_LR[args.optimizer]
    load_before = load_average()
    busy0, own0, t0 = *cpu_seconds(), time.monotonic()
    print(f"# {hardware()}; load average {load_before}", flush=True)
    rows, failures = [], []
    for world in args.world_sizes:
        modes = ["none"] if world == 1 else args.modes
        jobs = [(mode, make_cfg(args, mode, world)) for mode in modes]
        results = spawn(
            world, run_rank, jobs, args.steps, args.warmup, args.heap, timeout=args.timeout
        )
        for mode, _ in jobs:
            row, failed, parity = summarise(world, mode, [r[mode] for r in results])
            rows.append(row)
            failures += failed
            print(parity, flush=True)
            print(" | ".join(map(str, row)), flush=True)
    load_after = load_average()
    busy1, own1 = cpu_seconds()
    busy, own, wall = busy1 - busy0, own1 - own0, time.monotonic() - t0
    headers = ["W", "mode", *(f"{NAMES[k]} ms" for k in SYSTEMS)]
    headers += [f"{NAMES[k]} / hybridrec, paired (quartiles)" for k in SYSTEMS[1:]]
    headers += ["last loss", f"max loss gap to hybridrec, first {PARITY_STEPS} / all steps"]
    table = markdown_table(headers, rows)
    print(table)
    if failures:
        for line in failures:
            print(f"torchrec_step: {line}", file=sys.stderr)
        print("torchrec_step: no report written", file=sys.stderr)
        return 1
    if args.out is not None:
        model = MODELS[args.model] if args.model in MODELS else f"conf/model/{args.model}.yaml"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(
            "# hybridrec vs TorchRec on CPU/gloo: whole training steps, interleaved\n\n"
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
            f"- Model `{args.model}`: {model}; optimizer {args.optimizer} "
            f"(lr {args.lr}); global batch {args.batch_size}; median of {args.steps} steps "
            f"after {args.warmup} warmup, slowest rank per step; ratios paired per step. "
            "Method: the docstring of benchmarks/torchrec_step.py.\n"
            f"- Parity: every loss gap to hybridrec within the first {PARITY_STEPS} steps is "
            f"at most {PARITY_TOL:.0e} (checked; the run stops otherwise)\n\n"
            f"{table}\n"
        )
        tmp.replace(args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
