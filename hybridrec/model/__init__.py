"""DLRM models. Never imports torch.distributed: distribution is hybridrec.builder's job."""

from hybridrec.model.dlrm import DLRM, DenseArch
from hybridrec.model.inference import InferenceDLRM, PredictInputError, load_export
from hybridrec.model.interaction import DotInteraction, LowRankCrossNet
from hybridrec.model.mlp import MLP
from hybridrec.model.task import Task, bce_loss, mse_loss, task_of

__all__ = [
    "DLRM",
    "MLP",
    "PredictInputError",
    "DenseArch",
    "DotInteraction",
    "InferenceDLRM",
    "LowRankCrossNet",
    "load_export",
    "Task",
    "bce_loss",
    "mse_loss",
    "task_of",
]
