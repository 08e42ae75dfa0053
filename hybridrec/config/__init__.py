"""The run configuration: schema (defaults), validation, and the command line's view of it.

- `schema`: the dataclasses, the one source of default values (`Config` and its parts).
- `checks`: `validate(cfg, world_size)` -> a typed `Config`, or a ValueError naming the key.
- `cli`: `compose(overrides)` as hybridrec-train composes, override-key checks, model files.
"""

from hybridrec.config.checks import validate
from hybridrec.config.cli import (
    GROUPS,
    check_override_keys,
    compose,
    load_model_config,
    register_schema,
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
    "load_model_config",
    "register_schema",
    "validate",
]
