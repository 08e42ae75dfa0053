"""The built-in models (DLRM / DCNv2, two_tower, wide_deep), their declared tables, and scoring
exports. Never imports torch.distributed: distribution is hybridrec.shard's job."""

from hybridrec.model.dlrm import DLRM, DenseArch
from hybridrec.model.inference import (
    InferenceModel,
    PredictInputError,
    load_export,
)
from hybridrec.model.interaction import DotInteraction, LowRankCrossNet
from hybridrec.model.mlp import MLP
from hybridrec.model.task import Task, bce_loss, mse_loss, task_of
from hybridrec.model.zoo import TwoTower, WideDeep

__all__ = [
    "DLRM",
    "MLP",
    "PredictInputError",
    "DenseArch",
    "DotInteraction",
    "InferenceModel",
    "LowRankCrossNet",
    "load_export",
    "Task",
    "bce_loss",
    "mse_loss",
    "task_of",
    "TwoTower",
    "WideDeep",
]
