"""DLRM models. Never imports torch.distributed: distribution is hybridrec.parallelize's job."""

from hybridrec.model.dlrm import DLRM, DenseArch, loss_fn
from hybridrec.model.inference import InferenceDLRM, PredictInputError, load_export
from hybridrec.model.interaction import DotInteraction, LowRankCrossNet
from hybridrec.model.mlp import MLP

__all__ = [
    "DLRM",
    "MLP",
    "PredictInputError",
    "DenseArch",
    "DotInteraction",
    "InferenceDLRM",
    "LowRankCrossNet",
    "load_export",
    "loss_fn",
]
