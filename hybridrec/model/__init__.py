"""DLRM models, the built-in model classes (two_tower, wide_deep) and scoring exports. Never
imports torch.distributed: distribution is hybridrec.builder's and hybridrec.shard's job."""

from hybridrec.model.dlrm import DLRM, DenseArch
from hybridrec.model.inference import (
    InferenceDLRM,
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
    "InferenceDLRM",
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
