"""Where the model meets distribution: config + ranks -> a ready-to-train DLRM.

- sharding=none: every table in this process (hybridrec.sparse.EmbeddingCollection).
- any other sharding type: the planner places tables on ranks, every rank builds only its
  shards (hybridrec.sparse.sharded.ShardedEmbeddingCollection), and the dense part is wrapped
  in DistributedDataParallel. Embedding weights are buffers updated inside the backward, so
  DDP and the dense optimizer never see them.

Gradient-scaling convention (the one place it is written down): every rank's loss is the
mean over its local batch of B/W samples. DDP averages dense gradients over the W ranks, which
gives the gradient of the mean loss over the global batch B. Embedding gradients are not
averaged by any collective, so the sharded collection multiplies them by 1/W where they leave
the model (hybridrec.distributed.comm.ScaleGrad). Both then equal the single-process
reference's gradients on the same global batch.
"""

from __future__ import annotations

import logging

import torch

from hybridrec.config import Config
from hybridrec.distributed.env import DistEnv
from hybridrec.model import DLRM, DenseArch
from hybridrec.optim import build_sparse_optimizer
from hybridrec.sparse import EmbeddingCollection
from hybridrec.types import ShardingPlan

log = logging.getLogger("hybridrec")


def build_model(cfg: Config, env: DistEnv) -> tuple[DLRM, ShardingPlan | None]:
    """The model for this rank and the sharding plan (None for sharding=none)."""
    torch.manual_seed(cfg.seed)  # identical dense initialisation on every rank
    dense = DenseArch(cfg.model).to(env.device)
    sparse_opt = build_sparse_optimizer(cfg.optim.sparse)
    tables = cfg.model.tables()
    if cfg.sharding.type == "none":
        if env.world_size > 1:
            raise ValueError(
                f"sharding=none keeps every table in one process, but {env.world_size} ranks "
                "were started; choose sharding=table_wise|column_wise|row_wise|data_parallel|auto"
            )
        emb = EmbeddingCollection(tables, sparse_opt, cfg.seed, env.device, cfg.train.check_ids)
        return DLRM(dense, emb), None
    raise ValueError(f"sharding.type={cfg.sharding.type!r} is not available yet")
