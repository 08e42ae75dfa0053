"""The run configuration: schema (defaults), checks, and the command line's view of it.

A leaf: it imports only hybridrec.types, so every layer may read it. Validation against the
components' own choice lists (optimizers, loaders, ...) is `hybridrec.configure.validate`,
above every component.

- `schema`: the dataclasses, the one source of default values (`Config` and its parts).
- `checks`: `check_config(cfg, choices, world_size)` -> a typed `Config`, or a ValueError
  naming the key.
- `cli`: `compose(overrides)` as hybridrec-train composes, override-key checks, model files.
"""

from hybridrec.config.cli import (
    GROUPS,
    check_override_keys,
    compose,
    model_file,
    register_schema,
    resolve_run_length,
)
from hybridrec.config.schema import (
    ARCHS,
    CONF_DIR,
    DATA_KEYS,
    DEVICES,
    TABLE_DTYPES,
    CheckpointConfig,
    Config,
    DataConfig,
    DenseOptimConfig,
    DistConfig,
    EvalConfig,
    LauncherConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    PreprocessConfig,
    ScheduleConfig,
    ShardingConfig,
    SparseOptimConfig,
    TrainLoopConfig,
    fields_at,
)

__all__ = [
    "ARCHS",
    "CONF_DIR",
    "DATA_KEYS",
    "DEVICES",
    "GROUPS",
    "TABLE_DTYPES",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DenseOptimConfig",
    "DistConfig",
    "EvalConfig",
    "LauncherConfig",
    "LoggerConfig",
    "ModelConfig",
    "OptimConfig",
    "PreprocessConfig",
    "ScheduleConfig",
    "ShardingConfig",
    "SparseOptimConfig",
    "TrainLoopConfig",
    "check_override_keys",
    "compose",
    "fields_at",
    "model_file",
    "register_schema",
    "resolve_run_length",
]
