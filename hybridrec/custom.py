"""Config -> a model class's model on this rank (`model.arch=two_tower|wide_deep`, or
`model._target_`): built by hybridrec.model.registry, sharded by hybridrec.parallelize.

`LibraryModel` is what the trainer, evaluator and checkpoints hold for such a model: the
same calling convention as DLRM, forward(dense [B, F], ids [B, H]) -> outputs [B] fp32, the
ids being the dataset's features in order, handed to the model as KeyedIds. `net` is the
user's module (DDP-wrapped on several ranks); its state dict minus the embedding storage is
the dense state checkpoints save; `tables` are the stored tables by
qualified name ("<module path>.<table>"), which plans, shards and exports are named by.
Sharding, planner options, host caches and the sparse optimizer come from cfg as for DLRM;
`train.compile` does not apply (the embedding storage sits inside the user's forward).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybridrec.builder import table_dtype, verify_same_everywhere
from hybridrec.config import Config
from hybridrec.distributed.env import DistEnv
from hybridrec.kernels.dispatch import set_kernels
from hybridrec.model.registry import make_model, model_class
from hybridrec.model.tables import declared_tables
from hybridrec.optim import build_sparse_optimizer
from hybridrec.planner import CachePolicy
from hybridrec.shard import parallelize, qualified
from hybridrec.sparse.api import EmbeddingModule, IdCounts
from hybridrec.sparse.local import HostOptions
from hybridrec.types import KeyedIds, ShardingPlan, TableConfig


def declared_features(model: nn.Module) -> list[TableConfig]:
    """Every declaration's features, qualified ("<module path>.<feature>"), in module order."""
    return [f for path, t in declared_tables(model) for f in qualified(path, t)]


def stored_tables(cfg: Config) -> list[TableConfig]:
    """The features the model stores, as checkpoints name them: the dataset's for DLRM, the
    declarations' qualified ones for a model class (built without rows to read them)."""
    if not cfg.model.built_by_class():
        return list(cfg.model.tables())
    return declared_features(make_model(cfg.model, model_class(cfg.model)))


class LibraryModel(nn.Module):
    """A model class's model as the trainer drives it (module docstring)."""

    def __init__(self, net: nn.Module, data: tuple[TableConfig, ...]) -> None:
        super().__init__()
        self.net = net
        self.names = tuple(f.name for f in data)
        self.hotness = tuple(f.hotness for f in data)
        inner = self.inner
        self.tables = declared_features(inner)
        index = {n: i for i, n in enumerate(self.names)}
        self._inputs: dict[int, tuple[tuple[str, ...], list[int]]] = {}
        for _, t in declared_tables(inner):
            self._inputs[id(t.storage)] = (t.feature_names, [index[n] for n in t.feature_names])

    @property
    def inner(self) -> nn.Module:
        """The user's module (inside DDP on several ranks)."""
        return self.net.module if isinstance(self.net, DistributedDataParallel) else self.net

    def keyed(self, ids: torch.Tensor) -> KeyedIds:
        return KeyedIds(ids, self.names, self.hotness)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.net(dense, self.keyed(ids)).float()

    def module_ids(self, module: EmbeddingModule, ids: torch.Tensor) -> torch.Tensor:
        """The columns of a batch's ids [B, H] that embedding `module` looks up."""
        return self.keyed(ids).select(self._inputs[id(module)][0])

    def module_counts(self, module: EmbeddingModule, counts: IdCounts) -> IdCounts:
        """The data's id counts by the dataset's feature index, as `module` indexes them."""
        where = self._inputs[id(module)][1]
        return lambda f: counts(where[f])


def build_library_model(cfg: Config, env: DistEnv) -> tuple[LibraryModel, ShardingPlan]:
    """cfg's model class, its tables planned and sharded over env's ranks (or one process)."""
    torch.manual_seed(cfg.seed)  # identical dense initialisation on every rank
    set_kernels(cfg.train.kernels, env.device)
    net = make_model(cfg.model, model_class(cfg.model))
    s = cfg.sharding
    if s.type != "none" and env.group is None:
        raise ValueError(f"sharding={s.type} needs a process group (init_distributed)")
    wrapped = parallelize(
        net,
        batch_size=cfg.train.batch_size,
        sparse_optimizer=build_sparse_optimizer(cfg.optim.sparse),
        group=env.group,
        sharding=s.type,
        pins=s.tables,
        device=env.device,
        hbm_gb=s.hbm_gb,
        cache=CachePolicy(s.cache_fraction, s.cache_gb),
        seed=cfg.seed,
        check_ids=cfg.train.check_ids,
        dtype=table_dtype(cfg),
        host=HostOptions(s.pin_host, s.host_copy, s.cache_halflife),
    )
    world = env.world_size
    plans = [tp for _, t in declared_tables(net) for tp in t.plan.tables]  # type: ignore[union-attr]
    plan = ShardingPlan(world, tuple(plans))
    if world > 1:
        verify_same_everywhere(cfg, plan, env)
    return LibraryModel(wrapped, cfg.model.tables()), plan
