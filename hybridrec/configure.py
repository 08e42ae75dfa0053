"""A composed config checked against the components that implement its choices.

`hybridrec.config` is a leaf every layer reads: it imports no component. The names a user may
choose for some keys (sparse optimizers, data sources, loaders, readers, loggers, kernels, host
copies, model initialisations) belong to the component that implements them, in its own
list. This module sits above every component: CHOICES says which component answers for which
key, and `validate` passes them to the config's checks, with what else needs a component:
a table dataset fills the model's tables from its manifest first (hybridrec.data.table_model),
and a model class is imported and checked after (hybridrec.model.registry).

Entry points call this: hybridrec-train (hybridrec.main), hybridrec-plan, benchmarks, tests.
A new choice is added in its component's list alone; a new component-owned key adds a line
to CHOICES and to hybridrec.config.checks.COMPONENT_KEYS.
"""

from __future__ import annotations

from omegaconf import DictConfig

from hybridrec.config import Config, ModelConfig, model_file
from hybridrec.config.checks import check_config, composed
from hybridrec.data.build import SOURCES
from hybridrec.data.loader import LOADERS
from hybridrec.data.readers import READERS
from hybridrec.data.sequence_source import fill_model as fill_sequence_model
from hybridrec.data.table_model import fill_model
from hybridrec.kernels.dispatch import KERNEL_MODES
from hybridrec.model.mlp import MODEL_INITS
from hybridrec.model.registry import check_model_config
from hybridrec.optim.dense import DENSE_OPTIMIZERS
from hybridrec.optim.sparse import SPARSE_OPTIMIZERS
from hybridrec.sparse.host.copies import HOST_COPY_MODES
from hybridrec.train.loggers import LOGGERS, WANDB_MODES

# config key -> the names its component implements (the component's own list, read as is)
CHOICES = {
    "data.name": SOURCES,
    "data.reader": READERS,
    "data.loader": LOADERS,
    "model.init": MODEL_INITS,
    "optim.dense.name": DENSE_OPTIMIZERS,
    "optim.sparse.name": SPARSE_OPTIMIZERS,
    "logger.name": LOGGERS,
    "logger.mode": WANDB_MODES,
    "train.kernels": KERNEL_MODES,
    "sharding.host_copy": HOST_COPY_MODES,
}


def validate(cfg: DictConfig | dict | Config, world_size: int = 1) -> Config:
    """A composed config -> a typed, checked Config, or a ValueError naming the key.

    `world_size` is the number of ranks the run will use: the global batch must split evenly,
    and with no sharding chosen several ranks plan (`auto`). With `data=table` the model's
    table keys come from the dataset's manifest; a model class (`two_tower`, `wide_deep`,
    `model._target_`) must import, take `model.args` and declare its tables.
    """
    raw = composed(cfg)
    source = (raw.get("data") or {}).get("name")
    if source == "table":  # the model's tables come from the data
        raw = fill_model(raw)
    elif source == "sequences":
        raw = fill_sequence_model(raw)
    c = check_config(raw, CHOICES, world_size)
    if c.model.built_by_class():  # imports the user's class
        check_model_config(c.model)
    return c


def load_model_config(name_or_path: str) -> ModelConfig:
    """A model group file (`conf/model/<name>.yaml` or a path) as a validated ModelConfig."""
    return validate({"model": model_file(name_or_path)}).model
