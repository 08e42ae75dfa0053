"""Where the model meets distribution: config + ranks -> a ready-to-train DLRM.

- sharding=none: every table in this process (hybridrec.sparse.EmbeddingCollection).
- sharding=host (or auto past `sharding.hbm_gb`): tables, or the largest ones, in host memory
  with a device cache of hot rows (hybridrec.sparse.host), through the same sharded path.
- any other sharding type: the planner places tables on ranks, every rank builds only its
  shards (hybridrec.sparse.sharded.ShardedEmbeddingCollection), and the dense part is wrapped
  in DistributedDataParallel (on more than one rank: one rank, e.g. sharding=host on one
  GPU, has nothing to average). Embedding weights are buffers updated inside the backward,
  so DDP and the dense optimizer never see them.

Gradient-scaling convention (the one place it is written down): every rank's loss is the
mean over its local batch of B/W samples. DDP averages dense gradients over the W ranks, which
gives the gradient of the mean loss over the global batch B. Embedding gradients are not
averaged by any collective, so the sharded collection multiplies them by 1/W where they leave
the model (hybridrec.distributed.comm.ScaleGrad). Both then equal the single-process
reference's gradients on the same global batch.
"""

from __future__ import annotations

import inspect
import logging
import time

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybridrec.config import TABLE_DTYPES, Config
from hybridrec.distributed.comm import CommStats, all_gather_object
from hybridrec.distributed.env import DistEnv
from hybridrec.kernels.dispatch import set_kernels
from hybridrec.model import DLRM, DenseArch
from hybridrec.optim import build_sparse_optimizer
from hybridrec.planner import (
    CachePolicy,
    OptimizerFootprint,
    Topology,
    estimate_cost,
    format_plan,
    host_memory,
    human_bytes,
    plan_sharding,
    rank_memory,
)
from hybridrec.sparse import EmbeddingCollection
from hybridrec.sparse.host import check_host_memory
from hybridrec.sparse.layout import whole_values
from hybridrec.sparse.local import HostOptions
from hybridrec.sparse.sharded import ShardedEmbeddingCollection
from hybridrec.types import ShardingPlan

log = logging.getLogger("hybridrec")


def table_dtype(cfg: Config) -> torch.dtype:
    """The storage dtype of embedding weights (`model.table_dtype`)."""
    return getattr(torch, TABLE_DTYPES[cfg.model.table_dtype])


def comm_dtype(cfg: Config) -> torch.dtype:
    """The dtype of pooled embeddings in the all-to-alls (`sharding.comm_dtype`)."""
    return getattr(torch, TABLE_DTYPES[cfg.sharding.comm_dtype])


def make_plan(cfg: Config, world_size: int) -> ShardingPlan:
    """The planner's placement of cfg's tables on `world_size` ranks (pure, deterministic).

    sharding=host puts every table in host memory behind a device cache; auto does so for
    the largest tables only when they do not fit `sharding.hbm_gb`."""
    topology = Topology(world_size, int(cfg.sharding.hbm_gb * 2**30))
    return plan_sharding(
        cfg.model.tables(),
        topology,
        cfg.sharding.type,
        cfg.train.batch_size,
        OptimizerFootprint.for_optimizer(cfg.optim.sparse.name),
        weight_bytes=table_dtype(cfg).itemsize,
        data_parallel_max_bytes=cfg.sharding.data_parallel_max_bytes,
        cache=CachePolicy(cfg.sharding.cache_fraction, cfg.sharding.cache_gb),
        pins=cfg.sharding.tables,
    )


def check_memory(cfg: Config, plan: ShardingPlan, env: DistEnv) -> None:
    """Before allocating: this rank's host-resident tables must fit in host memory, and its
    planned device memory must fit in the GPU (a cache larger than the GPU is an error)."""
    footprint = OptimizerFootprint.for_optimizer(cfg.optim.sparse.name)
    wb = table_dtype(cfg).itemsize
    host_need = host_memory(plan, footprint, wb)[env.rank]
    if host_need:
        names = sorted(
            {tp.table for tp in plan.tables for s in tp.shards if s.on_host and s.rank == env.rank}
        )
        budget = None if cfg.sharding.host_gb is None else int(cfg.sharding.host_gb * 2**30)
        check_host_memory(
            host_need, budget, f"rank {env.rank}'s host-resident tables ({', '.join(names)})"
        )
    if env.device.type == "cuda":
        total = torch.cuda.get_device_properties(env.device).total_memory
        use = rank_memory(plan, cfg.model.tables(), cfg.train.batch_size, footprint, wb)
        need = use[env.rank].total
        if need > total:
            raise ValueError(
                f"rank {env.rank}: the plan puts {need / 2**30:.2f} GiB of embeddings, caches "
                f"and buffers on {env.device}, which has {total / 2**30:.2f} GiB; lower "
                "sharding.hbm_gb (the planner then moves tables to host memory with "
                "sharding=auto), sharding.cache_fraction or sharding.cache_gb"
            )


def plan_report(cfg: Config, plan: ShardingPlan, device: torch.device | None = None) -> str:
    """The readable plan table printed at start (exchanged bytes as they will be on
    `device`: see `bf16_wire`)."""
    tables = cfg.model.tables()
    topology = Topology(plan.world_size, int(cfg.sharding.hbm_gb * 2**30))
    comm_bytes = comm_dtype(cfg).itemsize
    if device is not None and bf16_wire(cfg, plan, device):
        comm_bytes = 2
    cost = estimate_cost(
        plan,
        tables,
        topology,
        cfg.train.batch_size,
        OptimizerFootprint.for_optimizer(cfg.optim.sparse.name),
        weight_bytes=table_dtype(cfg).itemsize,
        comm_bytes=comm_bytes,
    )
    return format_plan(plan, cost, tables)


def bf16_wire(cfg: Config, plan: ShardingPlan, device: torch.device) -> bool:
    """Whether the output dist will carry bf16 exactly (ShardedEmbeddingCollection.
    handoff_dtype): DLRM under bf16 autocast (CUDA) with no table split by rows, on more than
    one rank (one rank exchanges nothing)."""
    return (
        plan.world_size > 1
        and _handoff_in_autocast_dtype(cfg)
        and device.type == "cuda"
        and cfg.train.autocast == "bf16"
        and whole_values(plan)
    )


def _flat(cfg: Config) -> dict[str, str]:
    flat: dict[str, str] = {}

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            flat[prefix[:-1]] = repr(node)

    walk(OmegaConf.to_container(OmegaConf.structured(cfg)), "")
    return flat


def verify_same_everywhere(cfg: Config, plan: ShardingPlan, env: DistEnv) -> None:
    """All ranks must run the same config and plan; a mismatch is named at start, by key."""
    mine = (_flat(cfg), plan.fingerprint())
    gathered = all_gather_object(mine, env.group, "config_check")
    ref_cfg, ref_plan = gathered[0]
    for rank, (other_cfg, other_plan) in enumerate(gathered):
        diffs = [
            f"{k} ({ref_cfg.get(k)} on rank 0, {other_cfg.get(k)} on rank {rank})"
            for k in sorted(set(ref_cfg) | set(other_cfg))
            if ref_cfg.get(k) != other_cfg.get(k)
        ]
        if diffs:
            raise ValueError(f"ranks were started with different configs: {'; '.join(diffs)}")
        if other_plan != ref_plan:
            raise ValueError(
                f"rank {rank} computed a different sharding plan than rank 0 "
                f"({other_plan} vs {ref_plan}); check library versions"
            )


def _log_built(emb: ShardedEmbeddingCollection, env: DistEnv, start: float) -> None:
    """One line per rank-0 start: the embedding storage just initialised, where, how long
    (the 1TB model's host tables take a while; say what is happening)."""
    if not env.is_main:
        return
    on_device = sum(b.numel() * b.element_size() for b in emb.buffers())  # incl. caches
    on_host = 0  # host-resident tables and their optimizer state (plain attributes)
    for group in emb.host_groups():
        for t in (group.weight, *group.state().values()):
            on_host += t.numel() * t.element_size()
    where = f"{human_bytes(on_device)} on {env.device}"
    if on_host:
        where += f", {human_bytes(on_host)} in host memory"
    log.info(
        "embeddings initialised on this rank: %s, in %.1f s", where, time.perf_counter() - start
    )


def _handoff_in_autocast_dtype(cfg: Config) -> bool:
    """Whether the embeddings may hand the pooled embeddings over in the autocast dtype
    under autocast: for DLRM, whose dot interaction casts them to it before any other use
    (same bits, half the bytes; DCNv2 uses them in fp32 elementwise ops)."""
    return cfg.model.arch == "dlrm"


def build_model(
    cfg: Config, env: DistEnv, stats: CommStats | None = None
) -> tuple[DLRM, ShardingPlan | None]:
    """The model for this rank and the sharding plan (None for sharding=none)."""
    torch.manual_seed(cfg.seed)  # identical dense initialisation on every rank
    set_kernels(cfg.train.kernels, env.device)
    dense = DenseArch(cfg.model).to(env.device)
    sparse_opt = build_sparse_optimizer(cfg.optim.sparse)
    tables = cfg.model.tables()
    if cfg.sharding.type == "none":
        if env.world_size > 1:
            raise ValueError(
                f"sharding=none keeps every table in one process, but {env.world_size} ranks "
                "were started; choose sharding=table_wise|column_wise|row_wise|data_parallel|auto"
            )
        start = time.perf_counter()
        emb = EmbeddingCollection(
            tables, sparse_opt, cfg.seed, env.device, cfg.train.check_ids, table_dtype(cfg)
        )
        emb.autocast_output = _handoff_in_autocast_dtype(cfg)
        _log_built(emb, env, start)
        return DLRM(dense, emb), None
    if env.group is None:
        raise ValueError(f"sharding={cfg.sharding.type} needs a process group (init_distributed)")
    plan = make_plan(cfg, env.world_size)
    verify_same_everywhere(cfg, plan, env)
    check_memory(cfg, plan, env)
    if env.is_main:
        log.info(
            "sharding plan (%s, %d ranks):\n%s",
            cfg.sharding.type,
            env.world_size,
            plan_report(cfg, plan, env.device),
        )
        if bf16_wire(cfg, plan, env.device):
            log.info(
                "output dist in bf16 both ways: exact for DLRM under bf16 autocast (the dot "
                "interaction rounds to bf16 anyway), half the bytes of fp32"
            )
    start = time.perf_counter()
    emb = ShardedEmbeddingCollection(
        tables,
        plan,
        env.group,
        sparse_opt,
        seed=cfg.seed,
        device=env.device,
        check_ids=cfg.train.check_ids,
        stats=stats,
        dtype=table_dtype(cfg),
        host=HostOptions(
            cfg.sharding.pin_host, cfg.sharding.host_copy, cfg.sharding.cache_halflife
        ),
        comm_dtype=comm_dtype(cfg),
    )
    emb.autocast_output = _handoff_in_autocast_dtype(cfg)
    _log_built(emb, env, start)
    if env.world_size == 1:  # nothing to average: DDP would only copy gradients around
        return DLRM(dense, emb), plan
    ids = [env.device.index] if env.device.type == "cuda" else None
    # The dense part's only buffers are constant index tensors: no need to sync them per step.
    no_sync = (
        "forward_sync_buffers"
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else "broadcast_buffers"
    )
    dense = DistributedDataParallel(dense, device_ids=ids, **{no_sync: False})
    return DLRM(dense, emb), plan


def compile_dense(dense: nn.Module, mode: str, device: torch.device) -> nn.Module:
    """The dense part as `train.compile` says: torch.compile'd for `dense` (and `auto` on
    CUDA), also replayed as CUDA graphs for `graphs` (static shapes: every step has the same
    local batch, so per-kernel launch overhead goes), unchanged for `none`. The embedding
    side stays eager: its backward runs the optimizer."""
    if mode in ("dense", "graphs") or (mode == "auto" and device.type == "cuda"):
        compile_mode = "reduce-overhead" if mode == "graphs" else None
        return torch.compile(dense, dynamic=False, mode=compile_mode)  # type: ignore[return-value]
    return dense
