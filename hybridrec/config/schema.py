"""The config schema: every key, its type and its default, in one place.

These dataclasses are the only source of default values: `hybridrec.config.cli` stores them in
Hydra's ConfigStore as `base_config`, the first entry of conf/train.yaml's defaults list, and
the group files (conf/model/, conf/data/, ...) set only what their option changes.
`hybridrec.config.validate` turns a composed config into a typed, checked `Config`.
Comments beside fields are the user-facing meaning (docs/configuration.md lists them all).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrec.types import CACHE_HALFLIFE, Dynamic, Pooling, TableConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

ARCHS = ("dlrm", "dcnv2", "two_tower", "wide_deep", "sasrec", "hstu")
SEQUENCE_ARCHS = ("sasrec", "hstu")  # next-item models over a user's item sequence
DOT_ARCHS = ("dlrm", "dcnv2")  # the config-shaped DLRMs (bottom/top MLPs, interaction)
TABLE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEVICES = ("auto", "cpu", "cuda")

# The data.* keys each source (data.name) reads; the command line refuses the others (a
# data.path with synthetic data is a mistake, not a no-op). Every source keeps every key.
DATA_KEYS = {
    "synthetic": (
        "name",
        "zipf_exponent",
        "teacher_scale",
        "label_noise",
        "multi_hot",
        "loader",
        "prefetch",
    ),
    "criteo": (
        "name",
        "path",
        "reader",
        "dali_device",
        "loader",
        "prefetch",
        "shuffle",
        "last_batch",
        "eval_split",
        "verify",
        "multi_hot",
    ),
    "criteo_sample": (
        "name",
        "path",
        "cache_dir",
        "reader",
        "loader",
        "prefetch",
        "shuffle",
        "last_batch",
        "eval_split",
        "verify",
        "multi_hot",
        "preprocess",
    ),
    "table": (
        "name",
        "path",
        "spec",
        "reader",
        "dali_device",
        "loader",
        "prefetch",
        "shuffle",
        "last_batch",
        "eval_split",
        "verify",
    ),
    "sequences": ("name", "path", "loader", "prefetch", "shuffle", "eval_split", "sequence"),
}


@dataclass
class ModelConfig:
    """The model's shape (defaults: the dlrm_tiny model). Per-table keys (`hotness`,
    `pooling`, `jagged`) take one value for all tables or a list with one per table."""

    name: str = "dlrm_tiny"  # the model's name (conf/model/<name>.yaml)
    # dlrm (dot interaction) | dcnv2 (low-rank cross network) | two_tower (user and item
    # towers, dot product + biases) | wide_deep (width-1 tables + linear, and an MLP) |
    # sasrec (causal self-attention over a user's items) | hstu (HSTU's pointwise attention):
    # the last two read data=sequences, model.task=next_item
    arch: str = "dlrm"
    # your own model by import path (pkg.module.Class), instead of `arch`; its keyword
    # arguments go in model.args (docs/library.md, "Models by config")
    _target_: str | None = None
    # keyword arguments of the model class (two_tower, wide_deep or _target_): +model.args.k=v
    args: dict[str, Any] = field(default_factory=dict)
    # binary (BCE; AUC, log loss) | regression (MSE; RMSE, MAE) | retrieval (rows are positive
    # (user, item) pairs: softmax over the batch's items; HR@K, NDCG@K: train.retrieval) |
    # next_item (rows are users' sequences: the next item at every position; train.next_item)
    task: str = "binary"
    num_dense_features: int = 13  # dense (continuous) inputs per sample
    embedding_dim: int = 16  # width of every table (unless embedding_dims is set)
    # rows of each table (one table per categorical feature, named cat_0, cat_1, ...)
    num_embeddings_per_feature: list[int] = field(
        default_factory=lambda: [5000, 1200, 400, 100, 20, 4]
    )
    # one table name per feature; null = cat_0, cat_1, ... With feature_names, features
    # naming the same table share its rows (which must agree on rows and width)
    table_names: list[str] | None = None
    feature_names: list[str] | None = None  # one per feature; null = the table names
    embedding_dims: list[int] | None = None  # one width per table (dcnv2); null = embedding_dim
    hotness: Any = 1  # ids per sample per table (jagged: at most this many)
    pooling: Any = "sum"  # sum | mean (over a table's ids in one sample) | none (a sequence)
    jagged: Any = False  # bags hold 0..hotness ids, padded with -1 (list features)
    # average ids per bag of each table (list features; data=table fills it): the planner's
    # estimates; null = hotness
    mean_ids: list[float] | None = None
    # dynamic tables (docs/dynamic.md), {table: {admit, min_count, probability, evict,
    # ttl_steps, halflife, unknown, buckets}}: a table named here takes raw int64 ids, mapped
    # to its num_embeddings slots while training by this policy (unset keys: Dynamic's
    # defaults); data=table fills the spec's dynamic tables, and keys set here override them:
    # +model.dynamic.user.evict=lru
    dynamic: dict[str, dict[str, Any]] | None = None
    # last width must equal embedding_dim (dlrm)
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    # last width must be 1 (one logit)
    top_mlp: list[int] = field(default_factory=lambda: [64, 32, 1])
    dcn_layers: int = 3  # dcnv2 only: cross layers
    dcn_rank: int = 64  # dcnv2 only: rank of each cross layer
    # initial dense weights: reference (each arch's reference: DLRM's normal MLPs; MLPerf
    # DCNv2's nn.Linear MLPs and xavier_normal cross layers) | dlrm (DLRM's MLPs, nn.Linear
    # cross layers) | torch (nn.Linear's defaults everywhere)
    init: str = "reference"
    init_from: str | None = None  # warm start from a hybridrec-export file
    table_dtype: str = "fp32"  # fp32 | bf16 | fp16: embedding weights (optimizer math stays fp32)

    def built_by_class(self) -> bool:
        """Whether a model class builds this model (two_tower, wide_deep or a `_target_`:
        hybridrec.model.registry) rather than the model.* keys (dlrm, dcnv2)."""
        return self._target_ is not None or self.arch not in DOT_ARCHS

    def per_table(self, key: str) -> list[Any]:
        """`key`'s value for each table: a list as is, one value repeated."""
        n = len(self.num_embeddings_per_feature)
        value = getattr(self, key)
        if key == "embedding_dims" and value is None:
            value = self.embedding_dim
        return list(value) if isinstance(value, (list, tuple)) else [value] * n

    def hotness_list(self) -> list[int]:
        return [int(h) for h in self.per_table("hotness")]

    def dims(self) -> list[int]:
        return [int(d) for d in self.per_table("embedding_dims")]

    def dynamic_policy(self, table: str) -> Dynamic | None:
        """Storage table `table`'s policy from model.dynamic (None: a fixed table)."""
        policy = (self.dynamic or {}).get(table)
        return None if policy is None else Dynamic(**dict(policy))

    def tables(self) -> tuple[TableConfig, ...]:
        """One TableConfig per categorical feature, named by feature_names (looking up the
        table of table_names: shared when named twice), else by table_names, else cat_<t>."""
        n = len(self.num_embeddings_per_feature)
        tables = list(self.table_names) if self.table_names else [f"cat_{i}" for i in range(n)]
        names = list(self.feature_names) if self.feature_names else tables
        return tuple(
            TableConfig(
                name,
                int(rows),
                d,
                h,
                Pooling(p),
                bool(j),
                None if m is None else float(m),
                None if table == name else table,
                self.dynamic_policy(table),
            )
            for name, table, rows, d, h, p, j, m in zip(
                names,
                tables,
                self.num_embeddings_per_feature,
                self.dims(),
                self.hotness_list(),
                self.per_table("pooling"),
                self.per_table("jagged"),
                self.mean_ids if self.mean_ids is not None else [None] * n,
                strict=True,
            )
        )


@dataclass
class PreprocessConfig:
    """How data.name=criteo_sample preprocesses its raw file (hybridrec-preprocess options)."""

    encoding: str = "vocab"  # hash (id = value mod hash_cap) | vocab (frequency threshold)
    hash_cap: int = 40_000_000  # hash: ids per table
    min_count: int = 2  # vocab: values seen fewer times in train share one id
    split: str = "rows"  # rows (train_fraction of each file) | days (last file = val + test)
    train_fraction: float = 0.8  # split=rows: the first fraction of rows is train
    holdout_days: int = 1  # split=days: files held out for val + test
    block_rows: int = 8  # rows per checksummed block
    on_error: str = "error"  # error | skip: a malformed row
    checksums: bool = True  # write a sha256 per block


@dataclass
class SequenceDataConfig:
    """data=sequences: users' item sequences (hybridrec.data.sequence_source)."""

    max_len: int = 50  # events a model reads: the most recent (longer histories are cut)
    # auto (by suffix: .txt = user_item, .parquet/.csv = table) | user_item (`user item`
    # lines, 1-based ids, a user's lines contiguous and oldest first) | table (one row per
    # event: the columns below)
    format: str = "auto"
    user: str = "user"  # table: the user column
    item: str = "item"  # table: the item column (integers: row = item - item_base)
    time: str = "timestamp"  # table: the time column (a user's events in time order)
    item_base: int = 0  # table: the item column's first id (1 for 1-based ids)


@dataclass
class DataConfig:
    """Where batches come from. `synthetic`: an endless, seeded Criteo-shaped stream;
    `criteo`: a directory made by hybridrec-preprocess; `criteo_sample`: the 200 real rows;
    `table`: your own table, made by hybridrec-preprocess --spec (the model follows it)."""

    name: str = "synthetic"  # synthetic | criteo | criteo_sample | table | sequences
    zipf_exponent: float = 1.05  # id popularity ~ 1 / rank^s; larger = more skewed
    teacher_scale: float = 1.5  # spread of the hidden teacher's logits; larger = easier task
    label_noise: float = 0.0  # probability that a label is flipped after sampling
    # criteo, table: dataset dir; criteo_sample: the raw criteo_sample.tsv (null =
    # $HYBRIDREC_CRITEO_SAMPLE; the file is not in the repository)
    path: str | None = None
    spec: str | None = None  # table: the dataset spec (YAML) the data must have been made with
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
    sequence: SequenceDataConfig = field(default_factory=SequenceDataConfig)


@dataclass
class ShardingConfig:
    """How embedding tables are placed. `none` = one process holds every table."""

    # none | table_wise | column_wise | row_wise | data_parallel | auto | host; null (no
    # sharding= choice): none on one rank, auto (the planner) on several
    type: str | None = None
    hbm_gb: float = 16.0  # per-rank memory budget for embeddings, used by the planner
    data_parallel_max_bytes: int = 1 << 20  # `auto` replicates tables up to this size
    # Host-resident tables (type=host, or auto past hbm_gb) keep a device cache of hot rows:
    cache_fraction: float = 0.05  # rows cached per shard, as a fraction of its rows
    cache_gb: float | None = None  # or: GiB of caches per rank (rows + optimizer state)
    host_gb: float | None = None  # host RAM for tables per rank (default: what is free)
    pin_host: bool = True  # pinned host tables (on CUDA): faster copies, locked memory
    host_copy: str = "auto"  # rows move by a UVA kernel | staged copies | auto (the faster)
    # the caches' use counts halve every this many lookups of the cache (LFU with ageing; one
    # lookup per training step, and one per evaluation batch): longer remembers which rows are
    # popular better, shorter follows data whose popularity drifts faster
    cache_halflife: int = CACHE_HALFLIFE
    # tables whose sharding is fixed, {table: table_wise|column_wise|row_wise|data_parallel|
    # host}; `type` plans the others around them
    tables: dict[str, str] | None = None
    # pooled embeddings and their gradients in the all-to-alls: fp32 (exact) | bf16 | fp16
    comm_dtype: str = "fp32"


@dataclass
class DenseOptimConfig:
    name: str = "adam"  # sgd | adagrad | adam (torch.optim)
    lr: float = 1e-3  # learning rate of the MLPs
    eps: float = 1e-8  # adagrad, adam
    beta1: float = 0.9  # adam
    beta2: float = 0.999  # adam
    momentum: float = 0.0  # sgd
    weight_decay: float = 0.0  # every optimizer


@dataclass
class SparseOptimConfig:
    name: str = "rowwise_adagrad"  # sgd | rowwise_adagrad | adam | adagrad (touched rows only)
    lr: float = 0.05  # learning rate of the embedding tables
    eps: float = 1e-8  # rowwise_adagrad, adam, adagrad (torch.optim.Adagrad's default: 1e-10)
    beta1: float = 0.9  # adam
    beta2: float = 0.999  # adam
    # adam: eps added to the raw sqrt(v) as torch.optim.SparseAdam does (sparse_adam), or to
    # sqrt(v_hat) as torch.optim.Adam and FBGEMM do (adam)
    eps_form: str = "sparse_adam"
    # L2 regularisation of the rows each batch touches (lazy: untouched rows do not decay)
    weight_decay: float = 0.0
    weight_decay_mode: str = "l2"  # l2 (wd * w added to the gradient) | decoupled (AdamW)
    # tables with their own decay, {table: decay} (names as sharding.tables); the rest: weight_decay
    table_weight_decay: dict[str, float] | None = None


@dataclass
class ScheduleConfig:
    """Learning-rate warm-up and polynomial decay for both optimizers (hybridrec.optim.schedule)."""

    warmup_steps: int = 0  # linear warm-up over this many steps (0 = none)
    decay_start: int = 0  # polynomial decay starts after this step ...
    decay_steps: int = 0  # ... and lasts this many steps (0 = no decay)
    decay_power: float = 2.0  # polynomial degree of the decay
    end_factor: float = 0.0  # lr multiplier once the decay has ended


@dataclass
class OptimConfig:
    dense: DenseOptimConfig = field(default_factory=DenseOptimConfig)
    sparse: SparseOptimConfig = field(default_factory=SparseOptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass
class RetrievalConfig:
    """model.task=retrieval: the softmax over the global batch's items
    (hybridrec.train.retrieval)."""

    temperature: float = 1.0  # logits = score / temperature (smaller = sharper)
    # subtract log(expected count of the item among the candidates) from its logit, from the
    # training data's item counts (Yi et al., RecSys 2019): popular items are not over-penalised
    logq: bool = True
    # extra negatives per step, drawn uniformly from the catalogue (the same on every rank,
    # seeded by the step), besides the global batch's items
    negatives: int = 0
    # a candidate that is the row's own positive item (the same item in another row) is not
    # counted as a negative
    remove_accidental_hits: bool = False


@dataclass
class NextItemConfig:
    """model.task=next_item: the objective at every position of a sequence
    (hybridrec.train.next_item)."""

    # bce: sampled binary cross-entropy against `negatives` uniform items per position
    # (SASRec's, one) | softmax: over every rank's target items plus train.retrieval.negatives
    # uniform ones, logQ-corrected (train.retrieval's temperature, logq and hits apply)
    loss: str = "bce"
    negatives: int = 1  # bce: sampled items per position, never in the user's history


@dataclass
class TrainLoopConfig:
    steps: int = 3000  # optimizer steps (global batches)
    epochs: float | None = None  # passes over the train split (file data): sets `steps`
    batch_size: int = 1024  # the global batch, split evenly over ranks
    # where `steps` (or `epochs`) and the training data's batches count from. start: step 0,
    # so a resumed run ends where the interrupted one would have | resume: the step the run
    # resumed at (day by day: train.epochs=1 is one more pass over today's data, read from its
    # first batch); resumed again after a crash or stop (the same dataset), it ends where it
    # would have
    count_from: str = "start"
    log_every: int = 100  # log and write metrics.jsonl every this many steps
    check_ids: bool = True  # range-check every id before lookup (cheap; off once data is trusted)
    progress: str = "auto"  # auto (bar on a terminal) | bar | plain
    autocast: str = "bf16"  # bf16 | none: MLP precision on GPU (CPU always runs fp32)
    nonfinite: str = "error"  # error: stop, naming the step | skip: drop that step's update
    # auto (dense on CUDA) | dense: torch.compile the dense part | graphs: + CUDA graphs | none
    compile: str = "auto"
    kernels: str = "auto"  # embedding lookup/update: auto (Triton on CUDA) | torch | triton
    profile_steps: int = 0  # > 0: torch.profiler trace of this many steps (<run dir>/profile/)
    profile_start: int = 20  # ... starting after this step (past compilation and warm-up)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    next_item: NextItemConfig = field(default_factory=NextItemConfig)


@dataclass
class EvalConfig:
    every: int = 1000  # 0 = only at the end
    batches: int | None = 8  # global batches per evaluation; None = the whole eval split
    batch_size: int = 2048  # the global eval batch
    target_auc: float | None = None  # stop early once eval AUC reaches this (MLPerf: 0.8025)
    target_rmse: float | None = None  # model.task=regression: stop once eval RMSE is <= this
    only: bool = False  # evaluate the restored model (checkpoint or model.init_from), no training
    # val | test: after training, evaluate this whole split once more and log it as its own
    # metrics.jsonl row ("split": "test"), the last one (file data only; null = none)
    final_split: str | None = None
    # model.task=retrieval: the K of hr@K, recall@K and ndcg@K, each user's items ranked over
    # the whole catalogue, the items it met in earlier splits excluded
    topk: list[int] = field(default_factory=lambda: [10, 50])


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
    name: str = "none"  # none (metrics.jsonl and console) | wandb (also W&B, rank 0)
    project: str = "hybridrec"  # W&B project
    mode: str = "auto"  # auto = online if logged in to W&B, else offline
    entity: str | None = None  # W&B entity (null: the default)
    tags: list[str] = field(default_factory=list)  # W&B tags


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
    seed: int = 0  # seeds data, initialisation and shuffling
    device: str = "auto"  # auto (cuda when available) | cpu | cuda
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


def fields_at(path: str) -> list[str]:
    """Names of the schema keys under dotted `path` ('' = top level)."""
    node: Any = Config()
    for part in filter(None, path.split(".")):
        node = getattr(node, part, None)
        if not dataclasses.is_dataclass(node):
            return []
    return [f.name for f in dataclasses.fields(node)]
