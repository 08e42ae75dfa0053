"""Config -> the model to train on this rank: the model the config names, built as any model
is (hybridrec.model.registry.build_model: DLRM, DCNv2, two_tower, wide_deep or the user's
`model._target_`), compiled as `train.compile` says, then sharded by hybridrec.parallelize with
the `sharding.*` and `model.table_dtype` settings, exactly as a user's own script would shard
it. Nothing here asks what kind of model it builds.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybridrec.config import TABLE_DTYPES, Config
from hybridrec.config.checks import default_sharding
from hybridrec.distributed.comm import CommStats, all_gather_object
from hybridrec.distributed.env import DistEnv
from hybridrec.kernels.dispatch import set_kernels
from hybridrec.model.registry import build_model
from hybridrec.model.tables import declared_features
from hybridrec.optim import build_sparse_optimizer
from hybridrec.planner import CachePolicy
from hybridrec.shard import declarations, parallelize, plan_of, plan_request
from hybridrec.sparse.groups import HostOptions
from hybridrec.types import ShardingPlan, TableConfig

log = logging.getLogger("hybridrec")


def table_dtype(cfg: Config) -> torch.dtype:
    """The storage dtype of embedding weights (`model.table_dtype`)."""
    return getattr(torch, TABLE_DTYPES[cfg.model.table_dtype])


def comm_dtype(cfg: Config) -> torch.dtype:
    """The dtype of pooled embeddings in the all-to-alls (`sharding.comm_dtype`)."""
    return getattr(torch, TABLE_DTYPES[cfg.sharding.comm_dtype])


def model_features(cfg: Config) -> list[TableConfig]:
    """The features the config's model declares, as plans and checkpoints name them (the
    model is built without rows to read them)."""
    return declared_features(build_model(cfg.model))


def plan_options(cfg: Config, world_size: int = 1) -> dict[str, Any]:
    """The keyword arguments of hybridrec.parallelize that decide the plan (those of
    hybridrec.shard.plan_request), from the config, for `world_size` ranks (a config that
    chose no sharding gets the validation's default for them)."""
    s = cfg.sharding
    return {
        "batch_size": cfg.train.batch_size,
        "sparse_optimizer": build_sparse_optimizer(cfg.optim.sparse),
        "sharding": s.type if s.type is not None else default_sharding(world_size),
        "pins": s.tables,
        "hbm_gb": s.hbm_gb,
        "cache": CachePolicy(s.cache_fraction, s.cache_gb),
        "data_parallel_max_bytes": s.data_parallel_max_bytes,
        "dtype": table_dtype(cfg),
    }


def parallelize_options(cfg: Config, world_size: int = 1) -> dict[str, Any]:
    """hybridrec.parallelize's keyword arguments from the config (all but the model, group,
    device and stats), for `world_size` ranks: `plan_options` and the rest."""
    s = cfg.sharding
    return {
        **plan_options(cfg, world_size),
        "host_gb": s.host_gb,
        "seed": cfg.seed,
        "check_ids": cfg.train.check_ids,
        "host": HostOptions(s.pin_host, s.host_copy, s.cache_halflife),
        "comm_dtype": comm_dtype(cfg),
        "autocast": torch.bfloat16 if cfg.train.autocast == "bf16" else None,
        # the loaders hand every rank an equal slice (an uneven eval batch padded: rank_span)
        "equal_batches": True,
        "exact_shards": cfg.train.exact_shards if cfg.train.exact else None,
    }


def make_plan(cfg: Config, world_size: int) -> ShardingPlan:
    """The plan parallelize makes for cfg's model on `world_size` ranks (pure, no group)."""
    return plan_request(world_size, **plan_options(cfg, world_size)).plan(model_features(cfg))


def build(
    cfg: Config, env: DistEnv, stats: CommStats | None = None
) -> tuple[nn.Module, ShardingPlan]:
    """The model for this rank (DDP-wrapped on several ranks) and the plan its tables follow.
    Collective on several ranks: the configs must agree first (`verify_same_everywhere`)."""
    if env.world_size > 1:
        verify_same_everywhere(cfg, env)
    torch.manual_seed(cfg.seed)  # identical dense initialisation on every rank
    set_kernels(cfg.train.kernels, env.device)
    model = parallelize(
        build_model(cfg.model),
        group=env.group,
        device=env.device,
        stats=stats,
        **parallelize_options(cfg, env.world_size),
    )
    compile_model(model, cfg.train.compile, env.device)
    return model, plan_of(model)


def compile_model(model: nn.Module, mode: str, device: torch.device) -> None:
    """Compile a parallelized model in place as `train.compile` says: torch.compile for
    `dense` (and `auto` on CUDA), also replayed as CUDA graphs for `graphs` (static shapes:
    every step has the same local batch); nothing for `none`. The state dict keeps its keys.
    The tables' lookups stay eager (their backward runs the optimizer and the exchanges): the
    compiled graphs are the model's dense computation around them."""
    if mode in ("dense", "graphs") or (mode == "auto" and device.type == "cuda"):
        for tables in declarations(model):
            tables.keep_lookup_eager()
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        inner.compile(dynamic=False, mode="reduce-overhead" if mode == "graphs" else None)


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


def verify_same_everywhere(cfg: Config, env: DistEnv) -> None:
    """All ranks must run the same config; a mismatch is named at start, by key (a collective;
    parallelize then checks that they planned the same)."""
    gathered = all_gather_object(_flat(cfg), env.group, "config_check")
    ref_cfg = gathered[0]
    for rank, other_cfg in enumerate(gathered):
        diffs = [
            f"{k} ({ref_cfg.get(k)} on rank 0, {other_cfg.get(k)} on rank {rank})"
            for k in sorted(set(ref_cfg) | set(other_cfg))
            if ref_cfg.get(k) != other_cfg.get(k)
        ]
        if diffs:
            raise ValueError(f"ranks were started with different configs: {'; '.join(diffs)}")
