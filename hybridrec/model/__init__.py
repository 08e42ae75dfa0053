"""The built-in models (DLRM / DCNv2, two_tower, wide_deep) and their declared tables. Never
imports torch.distributed: distribution is hybridrec.shard's job.

`load_export`, `InferenceModel` and `PredictInputError` (scoring an exported model) are named
here as they always were, but live in hybridrec.inference, above the embedding storage it
scores with (hybridrec.sparse), which this package never imports: they are looked up there
on first use (`_ABOVE`), so `import hybridrec.model` loads no storage.
"""

from typing import Any

from hybridrec.model.dlrm import DLRM, DenseArch
from hybridrec.model.interaction import DotInteraction, LowRankCrossNet
from hybridrec.model.mlp import MLP
from hybridrec.model.task import Task, bce_loss, mse_loss, task_of
from hybridrec.model.zoo import TwoTower, WideDeep

# names of hybridrec.inference offered here (the module is named by string: not a dependency of
# this package, see tests/unit/test_layering.py)
_ABOVE = {
    name: "hybridrec.inference" for name in ("InferenceModel", "PredictInputError", "load_export")
}

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


def __getattr__(name: str) -> Any:
    """The scoring API (see the module docstring), imported on first use."""
    if name not in _ABOVE:
        raise AttributeError(f"module 'hybridrec.model' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_ABOVE[name]), name)
