"""check_config(): a composed config -> a typed, checked Config, or a ValueError naming the key.

Every mistake surfaces before any work starts, as one message that names the key and what it
accepts:

    unknown key    -> "unknown config key 'train.stpes'; keys under 'train': steps, epochs, ..."
    wrong value    -> "optim.sparse.name='adamw' is not one of: sgd, rowwise_adagrad, adam, ..."

This module imports only the schema and hybridrec.types: the config is a leaf that every layer
may read. The choices of the keys in COMPONENT_KEYS belong to the components that implement
them (optimizers, loaders, readers, loggers, kernels, ...) and come in as `choices`;
`hybridrec.configure.validate`, above every component, passes them (and fills a table
dataset's model, and checks a model class, before and after the checks here).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from hybridrec.config.dynamic import check_dynamic
from hybridrec.config.next_item import check_sequence_data
from hybridrec.config.schema import (
    ARCHS,
    DEVICES,
    TABLE_DTYPES,
    Config,
    ModelConfig,
    ScheduleConfig,
    fields_at,
)
from hybridrec.config.tasks import check_task
from hybridrec.config.values import choice as _choice
from hybridrec.config.values import positive as _positive
from hybridrec.types import (
    ADAM_EPS_FORMS,
    TASKS,
    WEIGHT_DECAY_MODES,
    Pooling,
    pin_modes,
    sharding_types,
    storage_tables,
)

log = logging.getLogger("hybridrec")

# The keys whose choices a component owns (hybridrec.configure.CHOICES maps each to the
# component's own list): check_config needs all of them.
COMPONENT_KEYS = (
    "data.name",
    "data.reader",
    "data.loader",
    "model.init",
    "optim.dense.name",
    "optim.sparse.name",
    "logger.name",
    "logger.mode",
    "train.kernels",
    "sharding.host_copy",
)
Choices = Mapping[str, Sequence[str]]


def _check_finite(node: object, prefix: str = "") -> None:
    """Every number of the config is finite: a NaN passes every comparison (`_positive`'s
    `value < 0` is False for it) and an infinity is no setting, so neither reaches a run. Walks
    the schema's dataclasses and their lists and mappings (model.args, a model class's own
    keyword arguments, are its class's to check)."""
    items: Sequence[tuple[str, object]]
    if dataclasses.is_dataclass(node):
        items = [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    elif isinstance(node, Mapping):
        items = [(str(k), v) for k, v in node.items()]
    else:  # a list
        items = [(f"[{i}]", v) for i, v in enumerate(node)]  # type: ignore[arg-type]
    for name, value in items:
        key = f"{prefix}{name}" if name.startswith("[") or not prefix else f"{prefix}.{name}"
        if key == "model.args":
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number, got {value}")
        if dataclasses.is_dataclass(value) or isinstance(value, (Mapping, list, tuple)):
            _check_finite(value, key)


def _check_pins(c: Config) -> None:
    pins = c.sharding.tables
    if not pins:
        return
    if c.sharding.type == "none":
        raise ValueError(
            "sharding.tables pins tables to sharding modes, but sharding=none keeps every table "
            "in one process; choose a planner mode (sharding=auto, table_wise, ...)"
        )
    names = [t.name for t in storage_tables(c.model.tables())]
    library = c.model.built_by_class()
    for name, mode in pins.items():
        if isinstance(mode, dict):  # sharding.tables.users.cat_0=... split at the dot
            inner = next(iter(mode), "<table>")
            raise ValueError(
                f"sharding.tables.{name}: a table name with a dot ({name}.{inner}) is pinned "
                f"as 'sharding.tables={{{name}.{inner}: row_wise}}'"
            )
        if name not in names and not library:  # a model class's tables: the planner checks
            raise ValueError(
                f"sharding.tables.{name}: model {c.model.name} has no table {name!r}; its "
                f"tables are {names[0]} .. {names[-1]}"
            )
        _choice(f"sharding.tables.{name}", mode, pin_modes())


def _check_sparse_decay(c: Config) -> None:
    """optim.sparse's weight decay: >= 0, a known mode, and per-table values for tables the
    model has (a model class's tables are checked by hybridrec.parallelize)."""
    o = c.optim.sparse
    _positive("optim.sparse.weight_decay", o.weight_decay, allow_zero=True)
    _choice("optim.sparse.weight_decay_mode", o.weight_decay_mode, WEIGHT_DECAY_MODES)
    _choice("optim.sparse.eps_form", o.eps_form, ADAM_EPS_FORMS)
    names = [t.name for t in storage_tables(c.model.tables())]
    for name, value in (o.table_weight_decay or {}).items():
        key = f"optim.sparse.table_weight_decay.{name}"
        if isinstance(value, dict):  # optim.sparse.table_weight_decay.users.user=... split
            inner = next(iter(value), "<table>")
            raise ValueError(
                f"{key}: a table name with a dot ({name}.{inner}) is given as "
                f"'optim.sparse.table_weight_decay={{{name}.{inner}: 0.01}}'"
            )
        if name not in names and not c.model.built_by_class():
            raise ValueError(
                f"{key}: model {c.model.name} has no table {name!r}; its tables are "
                f"{names[0]} .. {names[-1]}"
            )
        _positive(key, value, allow_zero=True)


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


def composed(cfg: DictConfig | dict | Config) -> DictConfig:
    """A composed config (Hydra's DictConfig, a plain dict or a Config) as a DictConfig,
    without Hydra's own `hydra` node."""
    if isinstance(cfg, Config):
        cfg = OmegaConf.structured(cfg)
    raw = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
    return OmegaConf.masked_copy(raw, [k for k in raw.keys() if k != "hydra"])


def check_config(cfg: DictConfig | dict | Config, choices: Choices, world_size: int = 1) -> Config:
    """Merge a composed config into the schema, check every value, return a typed Config.

    `choices` maps every key of COMPONENT_KEYS to the names its component implements.
    `world_size` is the number of ranks the run will use: the global batch must split evenly,
    and a config that chooses no sharding (sharding.type null) gets `none` on one rank and
    `auto` (the planner) on several, logged in one line.
    """
    missing = [k for k in COMPONENT_KEYS if k not in choices]
    if missing:  # a caller's mistake, not the user's: hybridrec.configure passes them all
        raise TypeError(f"check_config needs the components' choices of {', '.join(missing)}")
    raw = composed(cfg)
    check_sequence_data(OmegaConf.select(raw, "model.task"), OmegaConf.select(raw, "data.name"))
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
    except ConfigKeyError as e:
        full = str(e.full_key or e.key)
        parent = full.rsplit(".", 1)[0] if "." in full else ""
        where = f"under '{parent}'" if parent else "at the top level"
        allowed = ", ".join(fields_at(parent)) or "(none)"
        raise ValueError(f"unknown config key '{full}'; keys {where}: {allowed}") from None
    except OmegaConfBaseException as e:
        raise ValueError(_value_message(str(e.full_key), str(e.msg))) from None
    c: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if c.sharding.type is None:
        c.sharding.type = default_sharding(world_size)
    _check(c, world_size, choices)
    return c


def default_sharding(world_size: int) -> str:
    """The sharding of a run that chooses none: the one-process reference (`none`) on one
    rank; TorchRec's default on several, the planner (`auto`), said in one log line."""
    if world_size == 1:
        return "none"
    log.info(
        "sharding: %d ranks and no sharding chosen: the planner places the tables "
        "(sharding=auto; choose another with sharding=<mode>)",
        world_size,
    )
    return "auto"


def _per_table(m: ModelConfig, key: str, n: int, kind: type, allowed=None) -> None:  # noqa: ANN001
    """`model.<key>`: one value of `kind` or a list of n (each in `allowed` when given)."""
    value = getattr(m, key)
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and len(value) != n:
        raise ValueError(
            f"model.{key} has {len(value)} entries but there are {n} tables "
            "(model.num_embeddings_per_feature); give one per table or a single value"
        )
    ok = all(isinstance(v, kind) and (kind is bool or not isinstance(v, bool)) for v in values)
    if not ok:
        raise ValueError(
            f"model.{key} must be one {kind.__name__} or a list of {n} (one per table), "
            f"got {value!r}"
        )
    for v in values:
        if allowed is not None and v not in allowed:
            raise ValueError(f"model.{key}={v!r} is not one of: {', '.join(allowed)}")


def _check_tables(m: ModelConfig) -> None:
    """The per-table keys agree on the number of tables; the widths fit the architecture."""
    n = len(m.num_embeddings_per_feature)
    if n == 0:
        raise ValueError("model.num_embeddings_per_feature must list at least one table")
    for i, rows in enumerate(m.num_embeddings_per_feature):
        if rows < 1:
            raise ValueError(f"model.num_embeddings_per_feature[{i}] must be >= 1, got {rows}")
    _per_table(m, "hotness", n, int)
    if min(m.hotness_list()) < 1:
        raise ValueError(f"model.hotness entries must be >= 1, got {m.hotness}")
    _per_table(m, "pooling", n, str, tuple(p.value for p in Pooling))
    _per_table(m, "jagged", n, bool)
    for key in ("table_names", "feature_names", "embedding_dims", "mean_ids"):
        value = getattr(m, key)
        if value is not None and len(value) != n:
            raise ValueError(
                f"model.{key} has {len(value)} entries but there are {n} tables "
                "(model.num_embeddings_per_feature); give one per table"
            )
    if m.feature_names is not None and len(set(m.feature_names)) != n:
        raise ValueError(f"model.feature_names must be distinct, got {m.feature_names}")
    if m.feature_names is None and m.table_names is not None and len(set(m.table_names)) != n:
        raise ValueError(
            f"model.table_names must be distinct, got {m.table_names}; to share a table "
            "between features, name the features in model.feature_names"
        )
    check_dynamic(m)
    try:
        storage_tables(m.tables())
    except ValueError as e:
        raise ValueError(f"model: {e}") from None
    _positive("model.embedding_dim", m.embedding_dim)
    for t in m.tables():
        _positive(f"model.embedding_dims (table {t.name})", t.dim)
    if m.arch == "dlrm" and not m.built_by_class():
        _check_dot_widths(m)


def _check_dot_widths(m: ModelConfig) -> None:
    """DLRM's dot interaction multiplies every pair of vectors: one width for all of them."""
    widths: dict[int, list[str]] = {}
    for t in m.tables():
        widths.setdefault(t.dim, []).append(t.name)
    if len(widths) > 1:
        listed = "; ".join(f"width {d}: {', '.join(names)}" for d, names in sorted(widths.items()))
        raise ValueError(
            f"model.arch=dlrm needs one width for every table (its dot interaction multiplies "
            f"every pair), but the tables differ ({listed}); use model.arch=dcnv2, or one width"
        )
    d = next(iter(widths))
    if not m.bottom_mlp or m.bottom_mlp[-1] != d:
        raise ValueError(
            f"model.bottom_mlp must end with the tables' width, model.embedding_dim={d} (its "
            f"output joins the embeddings in the dot interaction), got {m.bottom_mlp}"
        )


def _check(c: Config, world_size: int, choices: Choices) -> None:
    m = c.model
    _check_finite(c)
    _choice("device", c.device, DEVICES)
    _choice("model.arch", m.arch, ARCHS)
    _choice("model.init", m.init, choices["model.init"])
    _choice("model.task", m.task, TASKS)
    _choice("model.table_dtype", m.table_dtype, tuple(TABLE_DTYPES))
    _choice("data.name", c.data.name, choices["data.name"])
    _check_data(c, choices)
    _choice("sharding.type", c.sharding.type, sharding_types())
    _choice("optim.dense.name", c.optim.dense.name, choices["optim.dense.name"])
    _choice("optim.sparse.name", c.optim.sparse.name, choices["optim.sparse.name"])
    _choice("logger.name", c.logger.name, choices["logger.name"])
    _choice("logger.mode", c.logger.mode, choices["logger.mode"])
    _choice("train.progress", c.train.progress, ("auto", "bar", "plain"))
    _choice("train.autocast", c.train.autocast, ("bf16", "none"))
    _choice("train.nonfinite", c.train.nonfinite, ("error", "skip"))
    _choice("train.count_from", c.train.count_from, ("start", "resume"))
    _choice("train.compile", c.train.compile, ("auto", "dense", "graphs", "none"))
    _choice("train.kernels", c.train.kernels, choices["train.kernels"])
    _positive("checkpoint.every", c.checkpoint.every, allow_zero=True)
    _positive("checkpoint.keep", c.checkpoint.keep)
    if c.checkpoint.resume not in ("auto", "never") and not c.checkpoint.resume:
        raise ValueError("checkpoint.resume must be auto, never or a checkpoint path")
    if c.eval.only and not (c.checkpoint.dir or c.model.init_from):
        raise ValueError(
            "eval.only evaluates a trained model: set checkpoint.dir (the newest checkpoint, or "
            "checkpoint.resume=<path>) or model.init_from=<hybridrec-export file>"
        )
    if c.eval.final_split is not None:
        _choice("eval.final_split", c.eval.final_split, ("val", "test"))
        if c.data.name == "synthetic":
            raise ValueError(
                f"eval.final_split={c.eval.final_split} evaluates a split of a file dataset "
                "(data=table, criteo, criteo_sample); data.name=synthetic has none"
            )
        if c.eval.only:
            raise ValueError(
                "eval.final_split runs after training; with eval.only, choose the split with "
                f"data.eval_split={c.eval.final_split} instead"
            )
    if c.eval.only and c.eval.batches == 0:
        raise ValueError("eval.only with eval.batches=0 evaluates nothing; give a number or null")
    if c.eval.target_auc is not None and not 0.5 < c.eval.target_auc <= 1.0:
        raise ValueError(f"eval.target_auc must be in (0.5, 1], got {c.eval.target_auc}")
    _check_tables(m)
    check_task(c)  # after the tables: a sequence check reads them
    _positive("model.num_dense_features", m.num_dense_features, allow_zero=True)
    if m.num_dense_features == 0 and not m.built_by_class():
        raise ValueError(
            f"model.arch={m.arch} needs dense inputs (its bottom MLP reads them) but the data has "
            "none (model.num_dense_features=0); train a model that reads none (model.arch="
            "two_tower, or your own model._target_), or add a dense column to the spec"
        )
    # a model class is imported and checked by hybridrec.configure; DLRM's keys here
    if not m.built_by_class():
        if m.args:
            raise ValueError(
                f"model.args {sorted(m.args)} are keyword arguments of a model class "
                f"(two_tower, wide_deep or model._target_); model.arch={m.arch} takes its "
                "settings from the model.* keys (bottom_mlp, top_mlp, ...)"
            )
        if not m.top_mlp or m.top_mlp[-1] != 1:
            raise ValueError(f"model.top_mlp must end with 1 (one output), got {m.top_mlp}")
        for key, widths in (("model.bottom_mlp", m.bottom_mlp), ("model.top_mlp", m.top_mlp)):
            if any(w < 1 for w in widths):
                raise ValueError(f"{key} widths must be >= 1, got {widths}")
    if m.arch == "dcnv2" and not m.built_by_class():
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
    _check_sparse_decay(c)
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
    _choice("sharding.host_copy", c.sharding.host_copy, choices["sharding.host_copy"])
    _positive("sharding.cache_halflife", c.sharding.cache_halflife)
    _check_pins(c)
    _choice("sharding.comm_dtype", c.sharding.comm_dtype, tuple(TABLE_DTYPES))
    if c.sharding.host_gb is not None:
        _positive("sharding.host_gb", c.sharding.host_gb)
    if not 0.0 <= c.data.label_noise < 0.5:
        raise ValueError(f"data.label_noise must be in [0, 0.5), got {c.data.label_noise}")
    _positive("data.zipf_exponent", c.data.zipf_exponent)
    # eval.batch_size need not divide: ranks pad their slices and the evaluator masks them
    b = c.train.batch_size
    if b % world_size:
        down, up = b - b % world_size, b + world_size - b % world_size
        fits = f"{down} or {up}" if down else str(up)
        raise ValueError(
            f"train.batch_size={b} is the global batch and must be divisible by the world size "
            f"{world_size} (every rank takes an equal slice); try train.batch_size={fits}"
        )


def _check_data(c: Config, choices: Choices) -> None:
    d, p = c.data, c.data.preprocess
    _choice("data.reader", d.reader, choices["data.reader"])
    _choice("data.dali_device", d.dali_device, ("auto", "cpu", "gpu"))
    _choice("data.loader", d.loader, choices["data.loader"])
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
    if d.spec is not None and d.name != "table":
        raise ValueError(f"data.spec applies to data=table, not data.name={d.name}")
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
