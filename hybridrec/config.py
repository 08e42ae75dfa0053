"""Structured config: the schema Hydra's composed YAML is checked against, in one place.

`conf/train.yaml` (plus its groups) is the user-facing source of defaults; the dataclasses
below are the schema. `validate(cfg)` merges the composed config into the schema and then
checks values, so every mistake surfaces before any work starts, as a ValueError that names
the key and what it accepts:

    unknown key    -> "unknown config key 'train.stpes'; keys under 'train': batch_size, ..."
    wrong value    -> "optim.sparse.name='adamw' is not one of: sgd, rowwise_adagrad, adam"
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from hybridrec.sparse.host import HOST_COPY_MODES
from hybridrec.types import CACHE_HALFLIFE, PIN_MODES, Pooling, TableConfig

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

ARCHS = ("dlrm", "dcnv2")
TABLE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEVICES = ("auto", "cpu", "cuda")
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")
SPARSE_OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam")
SHARDING_TYPES = (
    "none",
    "table_wise",
    "column_wise",
    "row_wise",
    "data_parallel",
    "auto",
    "host",
)
DATA_SOURCES = ("synthetic", "criteo", "criteo_sample")
DATA_READERS = ("memmap", "dali")
DATA_LOADERS = ("per_rank", "broadcast")
LOGGERS = ("none", "wandb")
WANDB_MODES = ("auto", "offline", "online", "disabled")


@dataclass
class ModelConfig:
    """DLRM shape. `hotness` is one int for all tables or one per table."""

    name: str = "dlrm_tiny"
    arch: str = "dlrm"
    num_dense_features: int = 13
    embedding_dim: int = 16
    num_embeddings_per_feature: list[int] = field(default_factory=lambda: [1000, 100, 10])
    hotness: Any = 1
    pooling: str = "sum"
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [64, 1])
    dcn_layers: int = 3
    dcn_rank: int = 64
    init_from: str | None = None  # warm start from a hybridrec-export file
    table_dtype: str = "fp32"  # fp32 | bf16 | fp16: embedding weights (optimizer math stays fp32)

    def hotness_list(self) -> list[int]:
        n = len(self.num_embeddings_per_feature)
        return [int(self.hotness)] * n if isinstance(self.hotness, int) else list(self.hotness)

    def tables(self) -> tuple[TableConfig, ...]:
        """One TableConfig per categorical feature, named cat_0 .. cat_{T-1}."""
        return tuple(
            TableConfig(f"cat_{i}", int(rows), self.embedding_dim, h, Pooling(self.pooling))
            for i, (rows, h) in enumerate(
                zip(self.num_embeddings_per_feature, self.hotness_list(), strict=True)
            )
        )


@dataclass
class PreprocessConfig:
    """How data.name=criteo_sample preprocesses its raw file (hybridrec-preprocess options)."""

    encoding: str = "vocab"  # hash (id = value mod hash_cap) | vocab (frequency threshold)
    hash_cap: int = 40_000_000
    min_count: int = 2  # vocab: values seen fewer times in train share one id
    split: str = "rows"  # rows (train_fraction of each file) | days (last file = val + test)
    train_fraction: float = 0.8
    holdout_days: int = 1
    block_rows: int = 8
    on_error: str = "error"  # error | skip: a malformed row
    checksums: bool = True


@dataclass
class DataConfig:
    """Where batches come from. `synthetic`: an endless, seeded Criteo-shaped stream;
    `criteo`: a directory made by hybridrec-preprocess; `criteo_sample`: the 200 real rows."""

    name: str = "synthetic"
    zipf_exponent: float = 1.05  # id popularity ~ 1 / rank^s; larger = more skewed
    teacher_scale: float = 1.5  # spread of the hidden teacher's logits; larger = easier task
    label_noise: float = 0.0  # probability that a label is flipped after sampling
    path: str | None = None  # criteo: dataset dir; criteo_sample: raw TSV (None = beside repo)
    cache_dir: str | None = None  # criteo_sample: None = $HYBRIDREC_CACHE or ~/.cache/hybridrec
    reader: str = "memmap"  # memmap | dali
    dali_device: str = "auto"  # auto (GPU when training on one) | cpu | gpu
    loader: str = "per_rank"  # per_rank (each rank reads its slice) | broadcast (rank 0 reads)
    prefetch: int = 2  # batches read ahead in a background thread (0 = none)
    shuffle: bool = True  # block-level shuffle of the train split, reseeded every epoch
    last_batch: str = "drop"  # drop | pad: the final partial global batch of a train epoch
    eval_split: str = "val"  # val | test: what evaluation reads
    verify: str = "read"  # size | read (checksum each block once when read) | full (at start)
    multi_hot: str = "none"  # none | synthetic: one-hot ids -> bags of model.hotness ids
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)


@dataclass
class ShardingConfig:
    """How embedding tables are placed. `none` = one process holds every table."""

    type: str = "none"
    hbm_gb: float = 16.0  # per-rank memory budget for embeddings, used by the planner
    data_parallel_max_bytes: int = 1 << 20  # `auto` replicates tables up to this size
    # Host-resident tables (type=host, or auto past hbm_gb) keep a device cache of hot rows:
    cache_fraction: float = 0.05  # rows cached per shard, as a fraction of its rows
    cache_gb: float | None = None  # or: GiB of caches per rank (rows + optimizer state)
    host_gb: float | None = None  # host RAM for tables per rank (default: what is free)
    pin_host: bool = True  # pinned host tables (on CUDA): faster copies, locked memory
    host_copy: str = "auto"  # rows move by a UVA kernel | staged copies | auto (the faster)
    # the caches' use counts halve every this many steps (LFU with ageing): longer remembers
    # which rows are popular better, shorter follows data whose popularity drifts faster
    cache_halflife: int = CACHE_HALFLIFE
    # tables whose sharding is fixed, {table: table_wise|column_wise|row_wise|data_parallel|
    # host}; `type` plans the others around them
    tables: dict[str, str] | None = None
    # pooled embeddings and their gradients in the all-to-alls: fp32 (exact) | bf16 | fp16
    comm_dtype: str = "fp32"


@dataclass
class DenseOptimConfig:
    name: str = "adam"
    lr: float = 1e-3
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    momentum: float = 0.0
    weight_decay: float = 0.0


@dataclass
class SparseOptimConfig:
    name: str = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999


@dataclass
class ScheduleConfig:
    """Learning-rate warm-up and polynomial decay for both optimizers (hybridrec.optim.schedule)."""

    warmup_steps: int = 0  # linear warm-up over this many steps (0 = none)
    decay_start: int = 0  # polynomial decay starts after this step ...
    decay_steps: int = 0  # ... and lasts this many steps (0 = no decay)
    decay_power: float = 2.0
    end_factor: float = 0.0  # lr multiplier once the decay has ended


@dataclass
class OptimConfig:
    dense: DenseOptimConfig = field(default_factory=DenseOptimConfig)
    sparse: SparseOptimConfig = field(default_factory=SparseOptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass
class TrainLoopConfig:
    steps: int = 300
    epochs: float | None = None  # passes over the train split (file data): sets `steps`
    batch_size: int = 256  # the global batch, split evenly over ranks
    log_every: int = 20
    check_ids: bool = True  # range-check every id before lookup (cheap; off once data is trusted)
    progress: str = "auto"  # auto (bar on a terminal) | bar | plain
    autocast: str = "bf16"  # bf16 | none: MLP precision on GPU (CPU always runs fp32)
    nonfinite: str = "error"  # error: stop, naming the step | skip: drop that step's update
    compile: str = "auto"  # dense: torch.compile the dense part | graphs: + CUDA graphs | none
    # | auto (dense on CUDA)
    kernels: str = "auto"  # embedding lookup/update: auto (Triton on CUDA) | torch | triton
    profile_steps: int = 0  # > 0: torch.profiler trace of this many steps (<run dir>/profile/)
    profile_start: int = 20  # ... starting after this step (past compilation and warm-up)


@dataclass
class EvalConfig:
    every: int = 100  # 0 = only at the end
    batches: int | None = 8  # global batches per evaluation; None = the whole eval split
    batch_size: int = 1024
    target_auc: float | None = None  # stop early once eval AUC reaches this (MLPerf: 0.8025)
    only: bool = False  # evaluate the restored model (checkpoint or model.init_from), no training


@dataclass
class CheckpointConfig:
    """Periodic, atomic, resharding checkpoints (hybridrec.train.checkpoint)."""

    dir: str | None = None  # where step_<N>/ directories go; None = no checkpoints
    every: int = 0  # save every N steps (0 = only at the end)
    resume: str = "auto"  # auto (newest complete one in dir) | never | <checkpoint path>
    keep: int = 3  # newest checkpoints kept
    verify: bool = True  # check every file's sha256 before loading


@dataclass
class LoggerConfig:
    name: str = "none"
    project: str = "hybridrec"
    mode: str = "auto"  # auto = online if logged in to W&B, else offline
    entity: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class DistConfig:
    timeout_s: float = 300.0  # every collective fails after this long instead of hanging


@dataclass
class LauncherConfig:
    """Ranks a run starts itself, without torchrun (hybridrec.train.sweep); ignored under it."""

    nproc_per_node: int = 1  # > 1: launch this many local ranks with torch elastic
    max_restarts: int = 0  # restart every rank this many times after a failure
    rdzv_timeout_s: float = 300.0  # how long ranks wait for each other at start-up


@dataclass
class Config:
    seed: int = 0
    device: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def _fields_at(path: str) -> list[str]:
    """Names of the schema keys under dotted `path` ('' = top level)."""
    node: Any = Config()
    for part in filter(None, path.split(".")):
        node = getattr(node, part, None)
        if not dataclasses.is_dataclass(node):
            return []
    return [f.name for f in dataclasses.fields(node)]


# config groups (`model=...`, `experiment=...`): the directories of conf/
GROUPS = tuple(sorted(p.name for p in CONF_DIR.glob("*") if p.is_dir()))


def check_override_keys(overrides: list[str]) -> None:
    """Command-line `key=value` overrides must name schema keys (Hydra alone would say only
    "not in struct"); the error lists the keys allowed where the typo is. Group choices
    (`model=...`), Hydra's own keys, additions (`+key=`) and deletions (`~key`) pass through:
    Hydra and validate() check those."""
    for arg in overrides:
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue
        key = arg.split("=", 1)[0]
        if key in GROUPS or key.startswith("hydra") or "@" in key or "/" in key:
            continue
        parts = key.split(".")
        for i, part in enumerate(parts):
            parent = ".".join(parts[:i])
            allowed = _fields_at(parent)
            if not allowed:  # inside a list or dict value: not the schema's to check
                break
            if part not in allowed:
                where = f"under '{parent}'" if parent else "at the top level"
                raise ValueError(f"unknown config key '{key}'; keys {where}: {', '.join(allowed)}")
    _check_data_keys(overrides)


def _data_group_keys(path: Path) -> DictConfig:
    """The `data` node of conf/data/<option>.yaml (some are `@package _global_`)."""
    cfg = OmegaConf.load(path)
    return cfg.data if "data" in cfg and "name" not in cfg else cfg


def _check_data_keys(overrides: list[str]) -> None:
    """A `data.<key>` the schema knows but the chosen dataset lacks (`data.path` with the
    default synthetic data): name the datasets that have it, not Hydra's "not in struct".
    Data keys differ by source on purpose (synthetic data has no path, reader or splits)."""
    keys = [a.split("=", 1)[0] for a in overrides if a.startswith("data.") and "=" in a]
    if not keys:
        return
    choices = [a for a in overrides if "=" in a and a.split("=", 1)[0] in GROUPS]
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            data = compose("train", overrides=choices).data
    except Exception:  # noqa: BLE001 - a sweep's "a,b" or a bad choice: Hydra reports those
        return
    for key in keys:
        name = key.split(".")[1]
        if name in data.keys():  # keys(): `in` is False for a mandatory ??? value
            continue
        groups = sorted(CONF_DIR.glob("data/*.yaml"))
        has = [p.stem for p in groups if name in _data_group_keys(p).keys()]
        hint = f"; choose a dataset that has it, e.g. data={has[0]} {key}=..." if has else ""
        raise ValueError(
            f"'{key}' is not a key of data={data.name}{hint} (keys of data={data.name}: "
            f"{', '.join(str(k) for k in data.keys())})"
        )


def _choice(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of: {', '.join(allowed)}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _check_pins(c: Config) -> None:
    pins = c.sharding.tables
    if not pins:
        return
    if c.sharding.type == "none":
        raise ValueError(
            "sharding.tables pins tables to sharding modes, but sharding=none keeps every table "
            "in one process; choose a planner mode (sharding=auto, table_wise, ...)"
        )
    names = [t.name for t in c.model.tables()]
    for name, mode in pins.items():
        if name not in names:
            raise ValueError(
                f"sharding.tables.{name}: model {c.model.name} has no table {name!r}; its "
                f"tables are {names[0]} .. {names[-1]}"
            )
        _choice(f"sharding.tables.{name}", mode, PIN_MODES)


def _check_schedule(s: ScheduleConfig) -> None:
    _positive("optim.schedule.warmup_steps", s.warmup_steps, allow_zero=True)
    _positive("optim.schedule.decay_start", s.decay_start, allow_zero=True)
    _positive("optim.schedule.decay_steps", s.decay_steps, allow_zero=True)
    _positive("optim.schedule.decay_power", s.decay_power)
    if not 0.0 <= s.end_factor <= 1.0:
        raise ValueError(f"optim.schedule.end_factor must be in [0, 1], got {s.end_factor}")
    if s.decay_steps > 0 and s.decay_start < s.warmup_steps:
        raise ValueError(
            f"optim.schedule.decay_start={s.decay_start} is inside the warm-up "
            f"(optim.schedule.warmup_steps={s.warmup_steps}): decay must start after it"
        )


_KINDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}


def _value_message(key: str, msg: str) -> str:
    """OmegaConf's conversion error as `<key> must be an integer, got 'abc'` (one line)."""
    m = re.match(r"Value '(.*?)' (?:of type '\w+' )?could not be converted to (\w+)", msg)
    if m and m.group(2) in _KINDS:
        return f"{key} must be {_KINDS[m.group(2)]}, got '{m.group(1)}'"
    first = msg.strip().splitlines()[0] if msg.strip() else "invalid value"
    return f"invalid config value for '{key}': {first}"


def validate(cfg: DictConfig | dict | Config, world_size: int = 1) -> Config:
    """Merge a composed config into the schema, check every value, return a typed Config.

    `world_size` is the number of ranks the run will use: the global batch must split evenly.
    """
    if isinstance(cfg, Config):
        cfg = OmegaConf.structured(cfg)
    raw = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
    raw = OmegaConf.masked_copy(raw, [k for k in raw.keys() if k != "hydra"])
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
    except ConfigKeyError as e:
        full = str(e.full_key or e.key)
        parent = full.rsplit(".", 1)[0] if "." in full else ""
        where = f"under '{parent}'" if parent else "at the top level"
        allowed = ", ".join(_fields_at(parent)) or "(none)"
        raise ValueError(f"unknown config key '{full}'; keys {where}: {allowed}") from None
    except OmegaConfBaseException as e:
        raise ValueError(_value_message(str(e.full_key), str(e.msg))) from None
    c: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    _check(c, world_size)
    return c


def _check(c: Config, world_size: int) -> None:
    m = c.model
    _choice("device", c.device, DEVICES)
    _choice("model.arch", m.arch, ARCHS)
    _choice("model.pooling", m.pooling, tuple(p.value for p in Pooling))
    _choice("model.table_dtype", m.table_dtype, tuple(TABLE_DTYPES))
    _choice("data.name", c.data.name, DATA_SOURCES)
    _check_data(c)
    _choice("sharding.type", c.sharding.type, SHARDING_TYPES)
    _choice("optim.dense.name", c.optim.dense.name, DENSE_OPTIMIZERS)
    _choice("optim.sparse.name", c.optim.sparse.name, SPARSE_OPTIMIZERS)
    _choice("logger.name", c.logger.name, LOGGERS)
    _choice("logger.mode", c.logger.mode, WANDB_MODES)
    _choice("train.progress", c.train.progress, ("auto", "bar", "plain"))
    _choice("train.autocast", c.train.autocast, ("bf16", "none"))
    _choice("train.nonfinite", c.train.nonfinite, ("error", "skip"))
    _choice("train.compile", c.train.compile, ("auto", "dense", "graphs", "none"))
    _choice("train.kernels", c.train.kernels, ("auto", "torch", "triton"))
    _positive("checkpoint.every", c.checkpoint.every, allow_zero=True)
    _positive("checkpoint.keep", c.checkpoint.keep)
    if c.checkpoint.resume not in ("auto", "never") and not c.checkpoint.resume:
        raise ValueError("checkpoint.resume must be auto, never or a checkpoint path")
    if c.eval.only and not (c.checkpoint.dir or c.model.init_from):
        raise ValueError(
            "eval.only evaluates a trained model: set checkpoint.dir (the newest checkpoint, or "
            "checkpoint.resume=<path>) or model.init_from=<hybridrec-export file>"
        )
    if c.eval.only and c.eval.batches == 0:
        raise ValueError("eval.only with eval.batches=0 evaluates nothing; give a number or null")
    if c.eval.target_auc is not None and not 0.5 < c.eval.target_auc <= 1.0:
        raise ValueError(f"eval.target_auc must be in (0.5, 1], got {c.eval.target_auc}")
    n = len(m.num_embeddings_per_feature)
    if n == 0:
        raise ValueError("model.num_embeddings_per_feature must list at least one table")
    for i, rows in enumerate(m.num_embeddings_per_feature):
        if rows < 1:
            raise ValueError(f"model.num_embeddings_per_feature[{i}] must be >= 1, got {rows}")
    if isinstance(m.hotness, bool) or not isinstance(m.hotness, (int, list)):
        raise ValueError(f"model.hotness must be an int or a list of {n} ints, got {m.hotness!r}")
    if isinstance(m.hotness, list):
        if len(m.hotness) != n or not all(isinstance(h, int) for h in m.hotness):
            raise ValueError(
                f"model.hotness has {len(m.hotness)} entries but there are {n} tables "
                "(model.num_embeddings_per_feature); give one int per table or a single int"
            )
    if min(m.hotness_list()) < 1:
        raise ValueError(f"model.hotness entries must be >= 1, got {m.hotness}")
    _positive("model.embedding_dim", m.embedding_dim)
    _positive("model.num_dense_features", m.num_dense_features)
    if not m.bottom_mlp or m.bottom_mlp[-1] != m.embedding_dim:
        raise ValueError(
            f"model.bottom_mlp must end with model.embedding_dim={m.embedding_dim} (its output "
            f"joins the embeddings in the interaction), got {m.bottom_mlp}"
        )
    if not m.top_mlp or m.top_mlp[-1] != 1:
        raise ValueError(f"model.top_mlp must end with 1 (one logit), got {m.top_mlp}")
    for key, widths in (("model.bottom_mlp", m.bottom_mlp), ("model.top_mlp", m.top_mlp)):
        if any(w < 1 for w in widths):
            raise ValueError(f"{key} widths must be >= 1, got {widths}")
    if m.arch == "dcnv2":
        _positive("model.dcn_layers", m.dcn_layers)
        _positive("model.dcn_rank", m.dcn_rank)
    _positive("train.steps", c.train.steps)
    if c.train.epochs is not None:
        _positive("train.epochs", c.train.epochs)
        if c.data.name == "synthetic":
            raise ValueError(
                f"train.epochs={c.train.epochs}: data=synthetic is endless (no epochs); "
                "set train.steps, or use a file dataset (data=criteo, data=criteo_sample)"
            )
    _positive("train.batch_size", c.train.batch_size)
    _positive("train.log_every", c.train.log_every)
    _positive("train.profile_steps", c.train.profile_steps, allow_zero=True)
    _positive("train.profile_start", c.train.profile_start, allow_zero=True)
    _positive("eval.every", c.eval.every, allow_zero=True)
    if c.eval.batches is not None:
        _positive("eval.batches", c.eval.batches, allow_zero=True)
    elif c.data.name == "synthetic":
        raise ValueError(
            "eval.batches=null evaluates the whole eval split, but data.name=synthetic is an "
            "endless stream; give a number of batches"
        )
    _positive("eval.batch_size", c.eval.batch_size)
    _positive("optim.dense.lr", c.optim.dense.lr)
    _positive("optim.sparse.lr", c.optim.sparse.lr)
    _check_schedule(c.optim.schedule)
    _positive("dist.timeout_s", c.dist.timeout_s)
    _positive("launcher.nproc_per_node", c.launcher.nproc_per_node)
    _positive("launcher.max_restarts", c.launcher.max_restarts, allow_zero=True)
    _positive("launcher.rdzv_timeout_s", c.launcher.rdzv_timeout_s)
    _positive("sharding.hbm_gb", c.sharding.hbm_gb)
    if not 0.0 < c.sharding.cache_fraction <= 1.0:
        raise ValueError(
            f"sharding.cache_fraction must be in (0, 1], got {c.sharding.cache_fraction}"
        )
    if c.sharding.cache_gb is not None:
        _positive("sharding.cache_gb", c.sharding.cache_gb)
    _choice("sharding.host_copy", c.sharding.host_copy, HOST_COPY_MODES)
    _positive("sharding.cache_halflife", c.sharding.cache_halflife)
    _check_pins(c)
    _choice("sharding.comm_dtype", c.sharding.comm_dtype, tuple(TABLE_DTYPES))
    if c.sharding.host_gb is not None:
        _positive("sharding.host_gb", c.sharding.host_gb)
    if not 0.0 <= c.data.label_noise < 0.5:
        raise ValueError(f"data.label_noise must be in [0, 0.5), got {c.data.label_noise}")
    _positive("data.zipf_exponent", c.data.zipf_exponent)
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    # eval.batch_size need not divide: ranks pad their slices and the evaluator masks them
    b = c.train.batch_size
    if b % world_size:
        down, up = b - b % world_size, b + world_size - b % world_size
        fits = f"{down} or {up}" if down else str(up)
        raise ValueError(
            f"train.batch_size={b} is the global batch and must be divisible by the world size "
            f"{world_size} (every rank takes an equal slice); try train.batch_size={fits}"
        )


def _check_data(c: Config) -> None:
    d, p = c.data, c.data.preprocess
    _choice("data.reader", d.reader, DATA_READERS)
    _choice("data.dali_device", d.dali_device, ("auto", "cpu", "gpu"))
    _choice("data.loader", d.loader, DATA_LOADERS)
    _choice("data.last_batch", d.last_batch, ("drop", "pad"))
    _choice("data.eval_split", d.eval_split, ("val", "test"))
    if d.name == "synthetic" and d.eval_split != "val":
        raise ValueError(
            f"data.eval_split={d.eval_split} picks a split of a file dataset (data=criteo, "
            "criteo_sample); data.name=synthetic has one eval stream"
        )
    _choice("data.verify", d.verify, ("size", "read", "full"))
    _choice("data.multi_hot", d.multi_hot, ("none", "synthetic"))
    if d.multi_hot == "synthetic" and d.name == "synthetic":
        raise ValueError(
            "data.multi_hot=synthetic expands a one-hot dataset (criteo, criteo_sample); "
            "data.name=synthetic already draws model.hotness ids per bag"
        )
    _positive("data.prefetch", d.prefetch, allow_zero=True)
    if d.name == "criteo" and not d.path:
        raise ValueError(
            "data.path must name a directory made by hybridrec-preprocess when data.name=criteo"
        )
    _choice("data.preprocess.encoding", p.encoding, ("hash", "vocab"))
    _choice("data.preprocess.split", p.split, ("rows", "days"))
    _choice("data.preprocess.on_error", p.on_error, ("error", "skip"))
    if not 1 <= p.hash_cap < 2**31:
        raise ValueError(f"data.preprocess.hash_cap must be in [1, 2^31), got {p.hash_cap}")
    _positive("data.preprocess.min_count", p.min_count)
    _positive("data.preprocess.block_rows", p.block_rows)
    _positive("data.preprocess.holdout_days", p.holdout_days, allow_zero=True)
    if not 0.0 < p.train_fraction <= 1.0:
        raise ValueError(
            f"data.preprocess.train_fraction must be in (0, 1], got {p.train_fraction}"
        )


def load_model_config(name_or_path: str) -> ModelConfig:
    """A model group file (`conf/model/<name>.yaml` or a path) as a validated ModelConfig."""
    path = Path(name_or_path)
    if not path.suffix:
        path = CONF_DIR / "model" / f"{name_or_path}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        raise ValueError(
            f"model {name_or_path!r} not found ({path}); choices: {', '.join(choices)}"
        )
    return validate({"model": OmegaConf.load(path)}).model
