"""`hybridrec.parallelize(model, ...)`: shard the embedding tables of any PyTorch model.

    model = hybridrec.parallelize(MyModel(), batch_size=4096,
                                  sparse_optimizer=RowWiseAdagrad(lr=0.05))
    opt = torch.optim.Adam(model.parameters())       # the dense part only
    loss = loss_fn(model(dense, ids), labels)         # ids: KeyedIds of this rank's samples
    loss.backward()                                   # embedding rows are updated here
    opt.step(); opt.zero_grad()

Every `EmbeddingTables` declared in the module tree (hybridrec.model.tables) is planned in one
plan over all their tables (named "<module path>.<table>", features likewise), and each gets
this rank's shards: a ShardedEmbeddingCollection over its features, exchanging over `group`.
With no process group (or sharding="none") every table lives in this process: the single-
process reference, built by the same code. On more than one rank the model is wrapped in
DistributedDataParallel, told to leave the embedding storage alone (its rows are buffers
updated in the backward, already exact on every rank); the rest averages its gradients.
Each rank feeds its own batch_size / W samples; losses are means over them, as in the
gradient-scaling rule of hybridrec.builder, so a run equals the one-process run on the
global batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybridrec.distributed.comm import world_size
from hybridrec.model.local import qualify
from hybridrec.model.tables import EmbeddingTables, declared_tables
from hybridrec.planner import (
    CachePolicy,
    OptimizerFootprint,
    Topology,
    estimate_cost,
    format_plan,
    plan_sharding,
)
from hybridrec.planner.types import NO_OPTIMIZER_STATE
from hybridrec.sparse.api import embedding_modules
from hybridrec.sparse.fused import RowOptimizer
from hybridrec.sparse.local import HostOptions
from hybridrec.sparse.sharded import ShardedEmbeddingCollection
from hybridrec.types import ShardingPlan, TableConfig, storage_tables

log = logging.getLogger("hybridrec")


def qualified(path: str, tables: EmbeddingTables) -> list[TableConfig]:
    """A declaration's features, named "<path>.<feature>" looking up "<path>.<table>"."""
    return [
        dataclasses.replace(f, name=qualify(path, f.name), storage=qualify(path, f.table_name))
        for f in tables.features
    ]


def _seed(seed: int, path: str) -> int:
    """Each declaration's initial rows from its own seed (two of the same shapes differ)."""
    digest = hashlib.sha256(f"{seed}/{path}".encode()).digest()
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
    cache: CachePolicy | None = None,
    seed: int = 0,
    check_ids: bool = True,
    dtype: torch.dtype = torch.float32,
    host: HostOptions | None = None,
) -> nn.Module:
    """Give every EmbeddingTables of `model` its shards on this rank; returns the model to
    train (DDP-wrapped on several ranks). Collective over `group` (None: the default group
    when torch.distributed is initialised, else one process).

    `batch_size`: the global batch (the planner sizes exchanges by it). `sharding`: a planner
    mode (auto, table_wise, column_wise, row_wise, data_parallel, host) or "none" (one
    process); `pins` fixes some tables' modes by qualified name ("users.user": "row_wise").
    `hbm_gb`: each rank's device budget for embeddings; `cache`: host tables' device caches.
    Raises ValueError (one line) for a model with no EmbeddingTables, or a plan that cannot be
    made."""
    declared = declared_tables(model)
    if not declared:
        raise ValueError(
            f"{type(model).__name__} declares no EmbeddingTables: nothing to shard (declare "
            "hybridrec.EmbeddingTables in the model, as docs/library.md shows)"
        )
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    world = world_size(group)
    features = [qualified(path, t) for path, t in declared]
    every = [f for fs in features for f in fs]
    device = torch.device(device)
    mode = sharding
    if sharding == "none":
        if world > 1:
            raise ValueError(f"sharding=none keeps every table in one process, not {world} ranks")
        mode = "table_wise"  # every table whole in this process: the single-process reference
    footprint = (
        OptimizerFootprint.for_optimizer(sparse_optimizer.name)
        if sparse_optimizer is not None
        else NO_OPTIMIZER_STATE
    )
    topology = Topology(world, int(hbm_gb * 2**30))
    plan = plan_sharding(
        every,
        topology,
        mode,
        batch_size,
        footprint,
        weight_bytes=dtype.itemsize,
        cache=cache,
        pins=pins,
    )
    rank = dist.get_rank(group) if group is not None else 0
    if rank == 0:
        cost = estimate_cost(plan, every, topology, batch_size, footprint, dtype.itemsize)
        log.info("sharding plan (%s, %d ranks):\n%s", mode, world, format_plan(plan, cost, every))
    by_table = {tp.table: tp for tp in plan.tables}
    for (path, tables), fs in zip(declared, features, strict=True):
        own = ShardingPlan(world, tuple(by_table[t.name] for t in storage_tables(fs)))
        storage = ShardedEmbeddingCollection(
            fs,
            own,
            group,
            sparse_optimizer,
            seed=_seed(seed, path),
            device=device,
            check_ids=check_ids,
            dtype=dtype,
            host=host,
        )
        tables.attach(storage, own)
    model.to(device)
    if world == 1:
        return model
    storage = tuple(qualify(path, "storage.") for path, _ in declared)
    ignore = [name for name, _ in model.named_buffers() if name.startswith(storage)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, process_group=group)


def check_inputs(model: nn.Module) -> None:
    """Raise, on every rank, for an out-of-range id that any rank's lookups met since the last
    call. On the CPU lookups check every batch before using it; on CUDA they do not stop for
    it (no host sync per step): a bad id reads row 0 until this call raises, naming the
    feature, the id and the sample. Collective on several ranks: call it at the same point on
    every rank, e.g. when you log."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    for m in embedding_modules(inner):
        m.check_inputs()
