"""`hybridrec.parallelize(model, ...)`: shard the embedding tables of any PyTorch model.

    model = hybridrec.parallelize(MyModel(), batch_size=4096,
                                  sparse_optimizer=RowWiseAdagrad(lr=0.05))
    opt = torch.optim.Adam(model.parameters())       # the dense part only
    loss = loss_fn(model(dense, ids), labels)         # ids: KeyedIds of this rank's samples
    loss.backward()                                   # embedding rows are updated here
    opt.step(); opt.zero_grad()

The one way any model is sharded: the trainer's built-in models (hybridrec.builder) and the
user's alike. Every `EmbeddingTables` declared in the module tree (hybridrec.model.tables) is
planned in one plan over all their tables (named "<namespace>.<table>", features likewise),
and each gets this rank's shards: a ShardedEmbeddingCollection over its features, exchanging
over `group`. With no process group (or sharding="none") every table lives in this process:
the single-process reference, built by the same code. On more than one rank the model is
wrapped in DistributedDataParallel, told to leave the embedding storage alone (its rows are
buffers updated in the backward, already exact on every rank) and the non-persistent buffers
(derived constants, such as an interaction's index tensors); the rest averages its gradients.
A model with no trainable parameter outside its tables (matrix factorisation) is not wrapped:
there is nothing to average.

Gradient-scaling convention (the one place it is written down): every rank's loss is the mean
over its local batch of B/W samples. DDP averages dense gradients over the W ranks, which gives
the gradient of the mean loss over the global batch B. Embedding gradients are averaged by no
collective, so the sharded collection multiplies them by 1/W where they leave the model
(hybridrec.distributed.comm.ScaleGrad). Both then equal the single-process reference's
gradients on the same global batch, so a run equals the one-process run on the global batch.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybridrec.distributed.comm import CommStats, all_gather_object, broadcast, world_size
from hybridrec.model.tables import EmbeddingTables, declared_tables
from hybridrec.planner import (
    CachePolicy,
    OptimizerFootprint,
    PlanRequest,
    Topology,
    format_plan,
    host_memory,
    human_bytes,
    rank_memory,
)
from hybridrec.planner.types import NO_OPTIMIZER_STATE
from hybridrec.sparse.api import embedding_modules
from hybridrec.sparse.exact import ExactCollection
from hybridrec.sparse.fused import RowOptimizer
from hybridrec.sparse.groups import HostOptions
from hybridrec.sparse.host import check_host_memory
from hybridrec.sparse.layout import whole_values
from hybridrec.sparse.sharded import ShardedEmbeddingCollection
from hybridrec.types import ShardingPlan, TableConfig, storage_tables

log = logging.getLogger("hybridrec")


def _seed(seed: int, namespace: str) -> int:
    """Each declaration's initial rows from its own seed (two of the same shapes differ); a
    declaration with plain names (namespace "", as DLRM's) takes `seed` itself."""
    if not namespace:
        return seed
    digest = hashlib.sha256(f"{seed}/{namespace}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def parallelize(
    model: nn.Module,
    *,
    batch_size: int,
    sparse_optimizer: RowOptimizer | None,
    group: dist.ProcessGroup | None = None,
    sharding: str = "auto",
    pins: Mapping[str, str] | None = None,
    device: torch.device | str = "cpu",
    hbm_gb: float = 16.0,
    host_gb: float | None = None,
    cache: CachePolicy | None = None,
    data_parallel_max_bytes: int = 1 << 20,
    seed: int = 0,
    check_ids: bool = True,
    dtype: torch.dtype = torch.float32,
    host: HostOptions | None = None,
    comm_dtype: torch.dtype = torch.float32,
    autocast: torch.dtype | None = None,
    equal_batches: bool = False,
    stats: CommStats | None = None,
    exact_shards: int | None = None,
) -> nn.Module:
    """Give every EmbeddingTables of `model` its shards on this rank; returns the model to
    train (DDP-wrapped on several ranks when it has dense parameters). Collective over
    `group` (None: the default group when torch.distributed is initialised, else one
    process).

    `batch_size`: the global batch (the planner sizes exchanges by it). `sharding`: a planner
    mode (auto, table_wise, column_wise, row_wise, data_parallel, host) or "none" (one
    process); `pins` fixes some tables' modes by qualified name ("users.user": "row_wise").
    `hbm_gb`: each rank's device budget for embeddings; `host_gb`: its host budget for
    host-resident tables (None: the free host memory); `cache`: host tables' device caches;
    `data_parallel_max_bytes`: auto replicates tables up to this size. `sparse_optimizer`
    (hybridrec.optim) also carries the tables' weight decay, per qualified table name in its
    `table_weight_decay` (checked here against the declared tables). `dtype`: the rows'
    storage dtype; `comm_dtype`: pooled embeddings in the all-to-alls (fp32 exact; bf16/fp16
    halve the bytes). `autocast`: the autocast dtype the forward runs under, if any (only
    for the bytes the printed plan counts). `equal_batches`: you promise that every rank feeds
    as many samples at every step; otherwise each step first shares the ranks' batch sizes (in
    the input dist's sizes exchange where it makes one, else a small all-gather), so that a
    last, uneven evaluation batch works and an uneven training batch is one clear error on
    every rank. `stats`: counts the bytes each exchange moves.
    `exact_shards`: exact mode (hybridrec.exact, docs/exact.md): the global batch is cut into
    this many micro-shards (the world size must divide it, and it the batch size), every
    sum over samples runs in one canonical order, so any world size gives one process's
    bits; train it with hybridrec.exact_step (the model is returned without DDP).
    Raises ValueError (one line) for a model with no EmbeddingTables, a model parallelized
    already, or a plan that cannot be made or does not fit."""
    declared = declared_tables(model)
    if not declared:
        raise ValueError(
            f"{type(model).__name__} declares no EmbeddingTables: nothing to shard (declare "
            "hybridrec.EmbeddingTables in the model, as docs/library.md shows)"
        )
    done = [path or "the model" for path, t in declared if t.storage is not None]
    if done:
        raise ValueError(
            f"{type(model).__name__} is parallelized already (EmbeddingTables {done[0]} has its "
            "rows): call hybridrec.parallelize once per model; a second call would "
            "re-initialise the trained rows"
        )
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    world = world_size(group)
    rank = dist.get_rank(group) if group is not None else 0
    if exact_shards is not None:
        _check_exact(exact_shards, world, batch_size)
    features = [t.qualified(path) for path, t in declared]
    every = [f for fs in features for f in fs]
    _check_table_decay(sparse_optimizer, [t.name for t in storage_tables(every)])
    device = torch.device(device)
    request = plan_request(
        world,
        batch_size=batch_size,
        sparse_optimizer=sparse_optimizer,
        sharding=sharding,
        pins=pins,
        hbm_gb=hbm_gb,
        cache=cache,
        data_parallel_max_bytes=data_parallel_max_bytes,
        dtype=dtype,
    )
    plan = request.plan(every)
    if world > 1:
        _same_plan_everywhere(plan, group, rank)
    _check_memory(plan, every, request, host_gb, device, rank)
    if rank == 0:
        tables = [t for _, t in declared]
        wire = wire_dtype(plan, tables, comm_dtype, autocast, device).itemsize
        table = format_plan(plan, request.cost(plan, every, wire), every)
        log.info("sharding plan (%s, %d ranks):\n%s", sharding, world, table)
        if autocast is not None and wire == autocast.itemsize != comm_dtype.itemsize:
            log.info(
                "output dist in %s both ways: exact, as the model declares (EmbeddingTables "
                "autocast_output: it casts the pooled embeddings first), half the bytes of fp32",
                str(autocast).removeprefix("torch."),
            )
    start = time.perf_counter()
    by_table = {tp.table: tp for tp in plan.tables}
    storages = []
    for (path, tables), fs in zip(declared, features, strict=True):
        own = ShardingPlan(world, tuple(by_table[t.name] for t in storage_tables(fs)))
        exact = {} if exact_shards is None else {"micro_shards": exact_shards}
        storage = (ExactCollection if exact else ShardedEmbeddingCollection)(
            fs,
            own,
            group,
            sparse_optimizer,
            seed=_seed(seed, tables.prefix(path)),
            device=device,
            check_ids=check_ids,
            stats=stats,
            dtype=dtype,
            host=host,
            comm_dtype=comm_dtype,
            autocast_output=tables.autocast_output,
            equal_batches=equal_batches,
            **exact,
        )
        tables.attach(storage, own)
        storages.append(storage)
    model.to(device)
    if rank == 0:
        _log_built(storages, device, start)
    if world == 1:
        return model
    if exact_shards is not None:  # no DDP: hybridrec.exact adds the gradients itself
        _same_dense_everywhere(model, group, declared)
        return model
    if not any(p.requires_grad for p in model.parameters()):
        log.info("no dense parameters to average: the model is not wrapped in DDP")
        return model
    storage_prefixes = tuple(f"{path}.storage." if path else "storage." for path, _ in declared)
    ignore = [n for n, _ in model.named_buffers() if n.startswith(storage_prefixes)]
    ignore += _non_persistent_buffers(model)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, process_group=group)


def _check_exact(exact_shards: int, world: int, batch_size: int) -> None:
    """Exact mode's micro-shards: each rank takes a whole number of them, of whole samples."""
    if exact_shards < 1 or exact_shards % world:
        raise ValueError(
            f"exact_shards={exact_shards} (train.exact_shards) must be a positive multiple of "
            f"the world size {world}: each rank takes exact_shards / {world} micro-shards"
        )
    if batch_size % exact_shards:
        raise ValueError(
            f"batch_size={batch_size} (train.batch_size) must be divisible by exact_shards="
            f"{exact_shards} (train.exact_shards): every micro-shard holds as many samples"
        )


def _same_dense_everywhere(
    model: nn.Module, group: dist.ProcessGroup, declared: list[tuple[str, EmbeddingTables]]
) -> None:
    """Rank 0's dense parameters and buffers on every rank (what DDP's construction does),
    the embedding storage left alone: exact mode's model is not wrapped in DDP."""
    prefixes = tuple(f"{path}.storage." if path else "storage." for path, _ in declared)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not name.startswith(prefixes):
            broadcast(t.data, dist.get_global_rank(group, 0), group, "dense_init")


def plan_request(
    world: int,
    *,
    batch_size: int,
    sparse_optimizer: RowOptimizer | None,
    sharding: str = "auto",
    pins: Mapping[str, str] | None = None,
    hbm_gb: float = 16.0,
    cache: CachePolicy | None = None,
    data_parallel_max_bytes: int = 1 << 20,
    dtype: torch.dtype = torch.float32,
) -> PlanRequest:
    """What `parallelize` with these arguments asks the planner for on `world` ranks (the
    arguments mean what they mean there; pure, no group): `plan_request(...).plan(features)`
    is the plan it makes (hybridrec.builder.make_plan: the trainer's plan without ranks)."""
    footprint = (  # what the optimizer keeps per row and element, from its state kinds
        OptimizerFootprint.of_state(sparse_optimizer.state_spec().values())
        if sparse_optimizer is not None
        else NO_OPTIMIZER_STATE
    )
    return PlanRequest(
        Topology(world, int(hbm_gb * 2**30)),
        sharding,
        batch_size,
        footprint,
        dtype.itemsize,
        data_parallel_max_bytes,
        cache,
        dict(pins or {}),
    )


def _check_table_decay(optimizer: RowOptimizer | None, names: list[str]) -> None:
    """A per-table weight decay must name tables the model declares (qualified names)."""
    named = getattr(optimizer, "table_weight_decay", None) or {}
    unknown = sorted(set(named) - set(names))
    if unknown:
        raise ValueError(
            f"the sparse optimizer's table_weight_decay (optim.sparse.table_weight_decay) names "
            f"unknown table(s) {', '.join(unknown)}; the model's tables are {', '.join(names)}"
        )


def wire_dtype(
    plan: ShardingPlan,
    tables: list[EmbeddingTables],
    comm_dtype: torch.dtype,
    autocast: torch.dtype | None,
    device: torch.device,
) -> torch.dtype:
    """The dtype pooled embeddings cross the network in: the autocast dtype when the output
    dist hands them over in it exactly (ShardedEmbeddingCollection.handoff_dtype: several
    ranks, CUDA autocast, every declaration's `autocast_output`, no table split by rows),
    else `comm_dtype`. What the printed plan counts."""
    handoff = all(t.autocast_output for t in tables) and whole_values(plan)
    if plan.world_size > 1 and handoff and autocast is not None and device.type == "cuda":
        return autocast
    return comm_dtype


def _non_persistent_buffers(model: nn.Module) -> list[str]:
    """Buffers a state dict leaves out: derived constants, nothing for DDP to broadcast."""
    out = []
    for name, module in model.named_modules():
        for b in module._non_persistent_buffers_set:
            out.append(f"{name}.{b}" if name else b)
    return out


def _same_plan_everywhere(plan: ShardingPlan, group: dist.ProcessGroup, rank: int) -> None:
    """Every rank must have planned the same: a difference is named at start, not a hang."""
    fingerprints = all_gather_object(plan.fingerprint(), group, "plan_check")
    other = next((r for r, f in enumerate(fingerprints) if f != fingerprints[0]), None)
    if other is not None:
        raise ValueError(
            f"rank {other} computed a different sharding plan than rank 0 (fingerprints "
            f"{fingerprints[other]} and {fingerprints[0]}); every rank must declare the same "
            "tables and pass the same parallelize arguments (and run the same versions)"
        )


def _check_memory(
    plan: ShardingPlan,
    features: list[TableConfig],
    request: PlanRequest,
    host_gb: float | None,
    device: torch.device,
    rank: int,
) -> None:
    """Before allocating: this rank's host-resident tables must fit in host memory (`host_gb`,
    else what is free), and its planned device memory (as `request` sized it) in the GPU."""
    footprint, wb = request.optimizer, request.weight_bytes
    host_need = host_memory(plan, footprint, wb)[rank]
    if host_need:
        names = sorted(
            {tp.table for tp in plan.tables for s in tp.shards if s.on_host and s.rank == rank}
        )
        budget = None if host_gb is None else int(host_gb * 2**30)
        what = f"rank {rank}'s host-resident tables ({', '.join(names)})"
        check_host_memory(host_need, budget, what)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        need = rank_memory(plan, features, request.batch_size, footprint, wb)[rank].total
        if need > total:
            raise ValueError(
                f"rank {rank}: the plan puts {need / 2**30:.2f} GiB of embeddings, caches and "
                f"buffers on {device}, which has {total / 2**30:.2f} GiB; lower sharding.hbm_gb "
                "(the planner then moves tables to host memory with sharding=auto), "
                "sharding.cache_fraction or sharding.cache_gb"
            )


def _log_built(
    storages: list[ShardedEmbeddingCollection], device: torch.device, start: float
) -> None:
    """One line at start: the embedding storage just initialised, where, how long (the 1TB
    model's host tables take a while; say what is happening)."""
    on_device = sum(b.numel() * b.element_size() for m in storages for b in m.buffers())
    on_host = 0  # host-resident tables and their optimizer state (plain attributes)
    for m in storages:
        for group in m.host_groups():
            for t in (group.weight, *group.state().values()):
                on_host += t.numel() * t.element_size()
    where = f"{human_bytes(on_device)} on {device}"
    if on_host:
        where += f", {human_bytes(on_host)} in host memory"
    log.info(
        "embeddings initialised on this rank: %s, in %.1f s", where, time.perf_counter() - start
    )


def plan_of(model: nn.Module) -> ShardingPlan:
    """The plan a parallelized model's tables follow (every declaration's, in module order)."""
    declared = declared_tables(_inner(model))
    plans = [t.plan for _, t in declared]
    if not declared or any(p is None for p in plans):
        raise ValueError("the model is not parallelized: call hybridrec.parallelize first")
    return ShardingPlan(plans[0].world_size, tuple(tp for p in plans for tp in p.tables))


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def declarations(model: nn.Module) -> list[EmbeddingTables]:
    """A (parallelized) model's EmbeddingTables, in module order, inside DDP or not."""
    return [t for _, t in declared_tables(_inner(model))]


def check_inputs(model: nn.Module) -> None:
    """Raise, on every rank, for an out-of-range id that any rank's lookups met since the last
    call. On the CPU lookups check every batch before using it; on CUDA they do not stop for
    it (no host sync per step): a bad id reads row 0 until this call raises, naming the
    feature, the id and the sample. Collective on several ranks: call it at the same point on
    every rank, e.g. when you log."""
    for m in embedding_modules(model):
        m.check_inputs()
