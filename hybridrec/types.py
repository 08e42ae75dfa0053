"""Plain value types shared by every layer: tables, sharding plans, batches.

Everything here is a frozen dataclass or an enum with no behaviour beyond small helpers, so
that the planner (pure data in, data out), the sparse modules and the trainer can exchange
them without importing each other.

Tensor legend used across the package: B = batch size, T = number of tables (features),
H = total ids per sample (sum of every table's hotness), D = embedding width, W = world size.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

import torch

# re-exported from the dynamic-table policy's one home, torch-free for the dataset spec
from hybridrec.dynamic_policy import CACHE_HALFLIFE as CACHE_HALFLIFE
from hybridrec.dynamic_policy import DYNAMIC_ADMIT as DYNAMIC_ADMIT
from hybridrec.dynamic_policy import DYNAMIC_EVICT as DYNAMIC_EVICT
from hybridrec.dynamic_policy import DYNAMIC_UNKNOWN as DYNAMIC_UNKNOWN
from hybridrec.dynamic_policy import Dynamic as Dynamic


@dataclass(frozen=True)
class ModeTraits:
    """What a sharding mode means: the runtime's layout and exchanges (hybridrec.sparse) and the
    planner's memory and cost models (hybridrec.planner) read these, never a mode's name.

    None set: whole tables (table_wise). A mode that only combines them needs no exchange
    code: its MODE_TRAITS entry, its rule (hybridrec.planner.plan.RULES) and a
    conf/sharding/<mode>.yaml (docs/architecture.md, "How to add").
    """

    # every rank holds the table whole and looks its ids up locally (no exchange); the rows'
    # gradients are synced between the replicas (planner: a sync buffer and its bytes)
    replicated: bool = False
    # units hold row ranges: pooled partial sums, added in shard order; a unit receives only
    # its range's ids and returns only the bags they touch (planner: ids, rows gathered and
    # pooled outputs scale with the range's share of the rows)
    partial_sums: bool = False
    # units hold column ranges: their outputs are concatenated (planner: as whole tables,
    # each unit with its width)
    concatenated: bool = False


# The sharding modes, by name, in the order choices are listed, and what each means. The one
# declaration of a mode's meaning: ShardingType accepts exactly these names, the config
# accepts them (`sharding.type`, `sharding.tables`) and the planner places each by its rule
# (hybridrec.planner.plan.RULES, one per name here).
MODE_TRAITS: dict[str, ModeTraits] = {
    "table_wise": ModeTraits(),  # whole table on one rank
    "column_wise": ModeTraits(concatenated=True),  # column slices on several ranks
    "row_wise": ModeTraits(partial_sums=True),  # row ranges on several ranks
    "data_parallel": ModeTraits(replicated=True),  # replicated on every rank
}


class _EveryMode(type):
    """Iterating ShardingType gives every mode of MODE_TRAITS (as iterating an Enum would)."""

    def __iter__(cls) -> Iterator[ShardingType]:
        return iter([cls(name) for name in MODE_TRAITS])


class ShardingType(str, metaclass=_EveryMode):
    """How one table is split across ranks: the name of a mode of MODE_TRAITS, with its
    `traits`. A str equal to its name, one object per name (`is` compares), an Enum member's
    repr; not an Enum, so that a MODE_TRAITS entry alone adds a mode (others: ValueError)."""

    __slots__ = ()
    TABLE_WISE: ClassVar[ShardingType]
    COLUMN_WISE: ClassVar[ShardingType]
    ROW_WISE: ClassVar[ShardingType]
    DATA_PARALLEL: ClassVar[ShardingType]

    def __new__(cls, name: str) -> ShardingType:
        if isinstance(name, ShardingType):
            return name
        if name not in MODE_TRAITS:
            raise ValueError(
                f"{name!r} is not a sharding mode; the modes are {', '.join(MODE_TRAITS)} "
                "(hybridrec.types.MODE_TRAITS)"
            )
        return _ONE_PER_NAME.setdefault(name, super().__new__(cls, name))

    @property
    def value(self) -> str:
        """The mode's name, a plain str (what configs, plan tables and checkpoints write)."""
        return str(self)

    @property
    def traits(self) -> ModeTraits:
        return MODE_TRAITS[self]

    def __repr__(self) -> str:
        return f"<ShardingType.{self.upper()}: {str.__repr__(self)}>"

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return ShardingType, (str(self),)


_ONE_PER_NAME: dict[str, ShardingType] = {}
ShardingType.TABLE_WISE = ShardingType("table_wise")
ShardingType.COLUMN_WISE = ShardingType("column_wise")
ShardingType.ROW_WISE = ShardingType("row_wise")
ShardingType.DATA_PARALLEL = ShardingType("data_parallel")


def pin_modes() -> tuple[str, ...]:
    """What `sharding.tables` may pin one table to: a mode of MODE_TRAITS (read when called:
    a mode added there is accepted at once), or host memory behind a device cache."""
    return (*MODE_TRAITS, "host")


def sharding_types() -> tuple[str, ...]:
    """What `sharding.type` may be: every table in one process (none), every table one way
    (a mode of MODE_TRAITS, as pin_modes), the planner's choice (auto), or in host memory."""
    return ("none", *MODE_TRAITS, "auto", "host")


class Pooling(str, Enum):
    """How the ids of one bag (one sample, one table) become one vector, or (NONE) stay a
    sequence: one row per id, in order (a feature's `hotness` is then its longest sequence)."""

    SUM = "sum"
    MEAN = "mean"
    NONE = "none"


class StateKind(str, Enum):
    """How much fp32 optimizer state a row optimizer keeps per table row (its `state_spec`).

    The kind, not a count, decides the shape: a width-1 table's element-wise state is [R, 1],
    like its weight, never [R], which is reserved for row-wise state.
    """

    ROW = "row"  # one value per row: [R] (row-wise Adagrad's sum)
    ELEMENT = "element"  # one value per weight element: [R, D] (Adam's moments, Adagrad's sum)

    def shape(self, rows: int, width: int) -> tuple[int, ...]:
        return (rows,) if self is StateKind.ROW else (rows, width)


STATE_BYTES = 4  # optimizer state is fp32, whatever the weight's dtype

# The sparse optimizers (`optim.sparse.name`, in the order choices are listed) and the state
# each keeps: state name -> its kind. The one declaration of a sparse optimizer's state: its
# class in hybridrec.optim.sparse reads it (`state_spec`), and the planner sizes it
# (hybridrec.planner.types.OptimizerFootprint) without importing the optimizers.
SPARSE_OPTIMIZER_STATE: dict[str, dict[str, StateKind]] = {
    "sgd": {},
    "rowwise_adagrad": {"sum": StateKind.ROW},
    "adam": {"exp_avg": StateKind.ELEMENT, "exp_avg_sq": StateKind.ELEMENT},
    "adagrad": {"sum": StateKind.ELEMENT},
}

# How a sparse optimizer's weight decay enters its step (`optim.sparse.weight_decay_mode`):
# l2 adds wd * w to the gradient, which then goes through the optimizer's maths (FBGEMM's L2
# mode, torch.optim's weight_decay); decoupled shrinks the row, w -= lr * wd * w, beside the
# adaptive step (AdamW; FBGEMM's DECOUPLE). Either way only the rows a batch touches decay.
WEIGHT_DECAY_MODES = ("l2", "decoupled")

# Where sparse Adam adds eps (`optim.sparse.eps_form`): "sparse_adam" to the raw sqrt(v), as
# torch.optim.SparseAdam does, the default; "adam" to the bias-corrected sqrt(v_hat), as
# torch.optim.Adam and FBGEMM (TorchRec) do. They differ where sqrt(v_hat) is near eps
ADAM_EPS_FORMS = ("adam", "sparse_adam")


# What a model learns from its labels (model.task): binary (BCE; AUC, log loss, NE),
# regression (MSE; RMSE, MAE), retrieval (every row a positive (user, item) pair: softmax
# over the global batch's items; HR@K, Recall@K, NDCG@K over the whole catalogue) or
# next_item (every row a user's sequence: the next item at every position; HR@K, NDCG@K of
# the held-out next item, over the whole catalogue and against 100 sampled items)
TASKS = ("binary", "regression", "retrieval", "next_item")

# The id that fills a jagged feature's bag past its length: "no id" (TableConfig.jagged)
PAD_ID = -1


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: `num_rows` x `dim`, looked up `hotness` times per sample.

    `jagged`: a sample's bag holds 0..hotness ids (a list feature, `hotness` = its max length),
    its columns padded with PAD_ID past its length; mean pooling divides by the ids present,
    and an empty bag pools to zeros. Not jagged: every bag holds exactly `hotness` ids.
    `pooling=NONE`: a sequence feature (always jagged): its lookup gives one row per column,
    [hotness, dim] per sample, a PAD_ID column's row zeros (`slots` output rows, not 1).
    `mean_ids`: a jagged table's average ids per bag, when known (the planner's estimates of
    exchanged bytes and lookups; memory is planned for `hotness`).

    Strictly this is one *feature*: its ids' columns, bags and pooling. `storage` names the
    embedding table whose rows it looks up when that is not a table of its own name: features
    with the same `storage` share one table (a user id and a list of followed user ids), which
    must then agree on `num_rows` and `dim`. Plans, checkpoints and exports name storage
    tables (`storage_tables`).
    """

    name: str
    num_rows: int
    dim: int
    hotness: int = 1
    pooling: Pooling = Pooling.SUM
    jagged: bool = False
    mean_ids: float | None = None
    storage: str | None = None
    dynamic: Dynamic | None = None

    def __post_init__(self) -> None:
        if self.num_rows < 1:
            raise ValueError(f"table {self.name!r}: num_rows must be >= 1, got {self.num_rows}")
        if self.dim < 1:
            raise ValueError(f"table {self.name!r}: dim must be >= 1, got {self.dim}")
        if self.hotness < 1:
            raise ValueError(f"table {self.name!r}: hotness must be >= 1, got {self.hotness}")
        object.__setattr__(self, "pooling", Pooling(self.pooling))
        if self.pooling is Pooling.NONE:
            object.__setattr__(self, "jagged", True)  # a sequence may be shorter than hotness
        if self.mean_ids is not None and not 0 <= self.mean_ids <= self.hotness:
            raise ValueError(
                f"table {self.name!r}: mean_ids must be in [0, hotness={self.hotness}], "
                f"got {self.mean_ids}"
            )
        d = self.dynamic
        if d is not None and not d.fits(self.num_rows):
            need = d.reserved_rows + 1  # a bucket's unknown row takes one slot
            raise ValueError(
                f"dynamic table {self.name!r}: num_rows {self.num_rows} must be a multiple "
                f"of buckets={d.buckets} with >= {need} rows per bucket"
                f"{' (one is its unknown row)' if need == 2 else ''}; change rows or buckets"
            )

    @property
    def sequence(self) -> bool:
        """A sequence feature: rows per id, not pooled (Pooling.NONE)."""
        return self.pooling is Pooling.NONE

    @property
    def slots(self) -> int:
        """Output rows per sample: `hotness` for a sequence, else 1 (one pooled row)."""
        return self.hotness if self.sequence else 1

    @property
    def expected_ids(self) -> float:
        """Ids per bag the planner expects: mean_ids for a jagged table when known, else
        hotness (exact for fixed bags, an upper bound for jagged ones)."""
        return self.mean_ids if self.jagged and self.mean_ids is not None else self.hotness

    @property
    def table_name(self) -> str:
        """The embedding table this feature looks up."""
        return self.storage if self.storage is not None else self.name


def storage_index(features: Sequence[TableConfig]) -> tuple[list[str], list[int]]:
    """(the storage tables' names in order of first use, each feature's index into them).
    Feature names must be distinct (ValueError)."""
    given = [f.name for f in features]
    duplicates = sorted({n for n in given if given.count(n) > 1})
    if duplicates:
        raise ValueError(f"duplicate table names: {duplicates}")
    names: list[str] = []
    of: list[int] = []
    for f in features:
        if f.table_name not in names:
            names.append(f.table_name)
        of.append(names.index(f.table_name))
    return names, of


def storage_tables(features: Sequence[TableConfig]) -> tuple[TableConfig, ...]:
    """One TableConfig per embedding table, in order of first use: what plans and memory
    count. A table looked up by one feature of its own name is that feature, unchanged;
    a shared one adds its features' ids per sample (hotness, expected ids) as its load.
    Features sharing a table must agree on its rows and width (ValueError naming them)."""
    names, of = storage_index(features)
    out = []
    for i, name in enumerate(names):
        users = [f for f, j in zip(features, of, strict=True) if j == i]
        first = users[0]
        for f in users[1:]:
            if f.dynamic != first.dynamic:
                raise ValueError(
                    f"features {first.name!r} and {f.name!r} share table {name!r} but give it "
                    "different dynamic policies; give every feature of one table the same"
                )
            if (f.num_rows, f.dim) != (first.num_rows, first.dim):
                raise ValueError(
                    f"features {first.name!r} and {f.name!r} share table {name!r} but give it "
                    f"{first.num_rows}x{first.dim} and {f.num_rows}x{f.dim} rows x width; "
                    "give every feature of one table the same rows and width"
                )
        if len(users) == 1 and first.name == name:
            out.append(first)
            continue
        jagged = any(f.jagged for f in users)
        mean = sum(f.expected_ids for f in users) if jagged else None
        out.append(
            TableConfig(
                name,
                first.num_rows,
                first.dim,
                sum(f.hotness for f in users),
                Pooling.SUM,
                jagged,
                mean,
                dynamic=first.dynamic,
            )
        )
    return tuple(out)


def hot_offsets(tables: tuple[TableConfig, ...] | list[TableConfig]) -> list[int]:
    """Column offsets of each table's ids in a batch's `ids` [B, H] tensor (len T + 1)."""
    offsets = [0]
    for t in tables:
        offsets.append(offsets[-1] + t.hotness)
    return offsets


def slot_offsets(tables: tuple[TableConfig, ...] | list[TableConfig]) -> list[int]:
    """Where each feature's output rows start in a collection's output [B, S, D] (len T + 1):
    one row per pooled feature, `hotness` rows per sequence feature (TableConfig.slots)."""
    offsets = [0]
    for t in tables:
        offsets.append(offsets[-1] + t.slots)
    return offsets


# What an embedding module's forward returns (hybridrec.sparse.api): the whole output
# [B, S, D] (one width: S rows per sample, slot_offsets) or [B, sum_f S_f * D_f]; or, where
# the exchange builds the features apart (sequences over ranks), one [B, S_f, D] per feature,
# in order, whose whole is their cat along dim 1 (hybridrec.model.tables.Pooled reads both).
Embedded = torch.Tensor | tuple[torch.Tensor, ...]


class KeyedIds:
    """A batch's ids by feature: `values` [B, H] int64 holds each feature's columns, in order,
    `hotness[i]` of them for feature `names[i]` (hot_offsets). `select(names)` gives the
    columns of some features, in the order asked: the same tensor when that is all of them,
    else one gather."""

    def __init__(self, values: torch.Tensor, names: Sequence[str], hotness: Sequence[int]):
        if len(names) != len(hotness):
            raise ValueError(f"KeyedIds: {len(names)} names but {len(hotness)} hotness values")
        if values.dim() != 2 or values.shape[1] != sum(hotness):
            raise ValueError(
                f"KeyedIds: values must be [B, {sum(hotness)}] for features {list(names)} "
                f"of hotness {list(hotness)}; got {list(values.shape)}"
            )
        self.values = values
        self.names = tuple(names)
        self.hotness = tuple(int(h) for h in hotness)
        starts = itertools.accumulate((0, *self.hotness))
        self._span = {  # feature -> its columns [a, b)
            n: (a, a + h) for n, h, a in zip(self.names, self.hotness, starts, strict=False)
        }

    def select(self, names: Sequence[str], hotness: Sequence[int] | None = None) -> torch.Tensor:
        """[B, sum of their hotness]: the columns of features `names`; `hotness`, when given,
        must match the batch's (ValueError naming the feature). Features that lie side by side
        in the batch, in the order asked, come as a view; others through one gather."""
        names = tuple(names)
        missing = [n for n in names if n not in self._span]
        if missing:
            raise ValueError(
                f"the batch has no feature(s) {missing}; its features are {list(self.names)}"
            )
        spans = [self._span[n] for n in names]
        for n, (a, b), h in zip(names, spans, hotness or [b - a for a, b in spans], strict=True):
            if b - a != h:
                raise ValueError(
                    f"feature {n!r}: the model expects {h} ids per sample, the batch has {b - a}"
                )
        if all(prev[1] == nxt[0] for prev, nxt in zip(spans, spans[1:], strict=False)):
            return self.values[:, spans[0][0] : spans[-1][1]] if spans else self.values[:, :0]
        cols = [c for a, b in spans for c in range(a, b)]
        return self.values.index_select(1, torch.tensor(cols, device=self.values.device))


@dataclass(frozen=True)
class ShardSpec:
    """One piece of a table: rows [row_start, row_end) x cols [col_start, col_end) on `rank`.

    `cache_rows` > 0 places the shard in host memory with a device cache of that many rows
    (hybridrec.sparse.host); 0 keeps the whole shard in device memory.
    """

    table: str
    rank: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    cache_rows: int = 0

    @property
    def on_host(self) -> bool:
        return self.cache_rows > 0

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def width(self) -> int:
        return self.col_end - self.col_start


@dataclass(frozen=True)
class TablePlan:
    """The sharding of one table and the planner's reason for it (shown in the plan table)."""

    table: str
    sharding: ShardingType
    shards: tuple[ShardSpec, ...]
    reason: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding", ShardingType(self.sharding))


@dataclass(frozen=True)
class ShardingPlan:
    """Per-table shards for `world_size` ranks, in the model's table order.

    For DATA_PARALLEL tables `shards` holds one full-table shard per rank.
    """

    world_size: int
    tables: tuple[TablePlan, ...]

    def table(self, name: str) -> TablePlan:
        for tp in self.tables:
            if tp.table == name:
                return tp
        raise KeyError(f"table {name!r} is not in the plan")

    def fingerprint(self) -> str:
        """A short stable hash of the plan, for checking that all ranks agree."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Batch:
    """One batch of Criteo-shaped samples.

    dense  [B, F] float32 (F = 13 for Criteo), already transformed (log1p)
    ids    [B, H] int64; table t's ids are columns hot_offsets[t]:hot_offsets[t+1]
    labels [B]    float32: in {0, 1} for model.task=binary, any value for regression
    """

    dense: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.ids.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def slice(self, start: int, end: int) -> Batch:
        """Samples [start, end): how a rank takes its part of a global batch."""
        return Batch(self.dense[start:end], self.ids[start:end], self.labels[start:end])

    def pin_memory(self) -> Batch:
        return Batch(self.dense.pin_memory(), self.ids.pin_memory(), self.labels.pin_memory())
