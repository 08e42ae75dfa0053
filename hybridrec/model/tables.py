"""Embedding tables declared inside a user's own model, and what they look up and return.

    class TwoTower(nn.Module):
        def __init__(self):
            super().__init__()
            self.users = EmbeddingTables(
                [Table("user", rows=943, dim=32)],
                [Feature("user_id", table="user"), Feature("friends", table="user", hotness=20,
                 jagged=True, pooling="mean")],
            )
            ...
        def forward(self, dense, ids):              # ids: KeyedIds (every feature of a batch)
            u = self.users(ids)                      # Pooled: u["user_id"] [B, 32]

A sequence feature (`pooling="none"`: a user's history, read in order) is looked up, not
pooled: `Feature("history", table="item", hotness=50, pooling="none")` gives
`out["history"]` [B, 50, D], row j the id in column j (oldest first, as the data lays them
out), a row of zeros where the column holds -1 (past the sequence's end); `out.mask(name)`
[B, 50] says which rows are real. Its rows are sharded, exchanged and updated like any other
table's (one row per id crosses the all-to-all, not a pooled sum).
            ...

An `EmbeddingTables` declares tables (name, rows, width) and the features that look them up
(name, table, ids per sample, pooling; several features may share a table). It holds no rows
itself: `hybridrec.parallelize(model, ...)` plans every declaration in the module tree, on one
process or many, and attaches each its storage (`attach`), an embedding module with the
contract of hybridrec.sparse.api (rows updated by the sparse optimizer in the backward). The
rest of the model stays plain PyTorch. Every model hybridrec trains, built-in or the user's,
declares its tables this way. This module never imports torch.distributed.

Plans, checkpoints and exports name a declaration's tables and features "<namespace>.<name>":
the namespace is the module path ("users.user") unless given (`namespace=""`: plain names, as
DLRM's tables have always been named). `autocast_output=True` declares that the model casts
the pooled output to the autocast dtype before any other use (DLRM's dot interaction does):
under autocast the storage may then hand it over in that dtype, half the bytes, the same bits.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridrec.types import Dynamic, Embedded, KeyedIds, Pooling, ShardingPlan, TableConfig

# integer ids narrower than int64, widened before the storage sees them (as int64 ids look up
# the same rows); float ids go on to the storage's id check, which refuses them
NARROW_IDS = (torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True)
class Table:
    """One embedding table: `rows` x `dim`. `dynamic`: its ids are raw int64 values from an
    open set, mapped to its `rows` slots while training by that policy (types.Dynamic)."""

    name: str
    rows: int
    dim: int
    dynamic: Dynamic | None = None


@dataclass(frozen=True)
class Feature:
    """One input feature looking up `table`: `hotness` ids per sample (a list feature with
    `jagged`: 0..hotness of them, padded with -1), pooled by `pooling` (sum or mean), or
    "none": a sequence of at most `hotness` ids, a row each (always padded with -1).
    `mean_ids`: a list's average length, when known (the planner's traffic estimate)."""

    name: str
    table: str
    hotness: int = 1
    pooling: str = "sum"
    jagged: bool = False
    mean_ids: float | None = None


class Pooled(Mapping[str, torch.Tensor]):
    """A collection's embeddings, by feature: `pooled[name]` is [B, D_f] for a pooled
    feature, [B, L_f, D_f] for a sequence (views). `tensor` is the whole output: [B, S, D]
    when every width is one D (S rows per sample: one per pooled feature, L_f per sequence),
    else [B, sum_f S_f * D_f]. `ids` (the looked-up columns, [B, H]) give sequences' masks.
    Built from what the storage returns (hybridrec.types.Embedded): the whole output, or
    each feature's [B, S_f, D] apart (then `tensor`, when asked for, is their cat)."""

    def __init__(
        self,
        tensor: Embedded,
        features: Sequence[TableConfig],
        ids: torch.Tensor | None = None,
    ) -> None:
        self._names = [f.name for f in features]
        self._features = {f.name: f for f in features}
        self._ids = ids
        self._whole: torch.Tensor | None = None
        # the features' parts: given apart, or from one torch.split of the whole on first use
        # (its backward is one cat of the parts' gradients, where a slice per feature costs a
        # zero-filled gradient of the whole output each, and their sum: per padded position too)
        self._parts: dict[str, torch.Tensor] | None = None
        if isinstance(tensor, tuple):
            self._parts = dict(zip(self._names, tensor, strict=True))
            three_d = True
        else:
            self._whole, three_d = tensor, tensor.dim() == 3
        self._three_d = three_d
        self._where: dict[str, tuple[int, int]] = {}  # rows [a, b), or columns when flat
        self._cols: dict[str, tuple[int, int]] = {}  # the feature's id columns
        a = c = 0
        for f in features:
            size = f.slots if three_d else f.slots * f.dim
            self._where[f.name] = (a, a + size)
            self._cols[f.name] = (c, c + f.hotness)
            a, c = a + size, c + f.hotness

    @property
    def tensor(self) -> torch.Tensor:
        """The whole output (see the class docstring)."""
        if self._whole is None:
            assert self._parts is not None
            self._whole = torch.cat(list(self._parts.values()), dim=1)
        return self._whole

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"no feature {name!r} in these tables; they look up {self._names}")
        if self._parts is None:  # every feature's part at once: see _parts
            sizes = [b - a for a, b in self._where.values()]
            parts = torch.split(self.tensor, sizes, dim=1)
            self._parts = dict(zip(self._names, parts, strict=True))
        f, out = self._features[name], self._parts[name]
        if self._three_d:
            return out if f.sequence else out.squeeze(1)
        return out.view(-1, f.slots, f.dim) if f.sequence else out

    def mask(self, name: str) -> torch.Tensor:
        """[B, L] bool: which positions of sequence feature `name` hold an id."""
        f = self._features.get(name)
        if f is None or not f.sequence:
            raise KeyError(f"{name!r} is not a sequence feature of these tables")
        if self._ids is None:
            raise ValueError("these embeddings were made without their ids: no mask")
        a, b = self._cols[name]
        return self._ids[:, a:b] >= 0

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class EmbeddingTables(nn.Module):
    """Tables and the features that look them up (see the module docstring).

    forward(ids: KeyedIds, or a Tensor [B, H] holding exactly these features' columns in
    order) -> Pooled. Raises ValueError at construction for a declaration that cannot work:
    no tables, a feature naming no declared table, repeated names, bad sizes."""

    def __init__(
        self,
        tables: Sequence[Table],
        features: Sequence[Feature] | None = None,
        *,
        namespace: str | None = None,
        autocast_output: bool = False,
    ):
        super().__init__()
        self.namespace = namespace
        self.autocast_output = autocast_output
        tables = list(tables)
        if not tables:
            raise ValueError("EmbeddingTables needs at least one Table")
        by_name = {t.name: t for t in tables}
        if len(by_name) != len(tables):
            raise ValueError(f"EmbeddingTables: table names repeat in {[t.name for t in tables]}")
        if features is None:  # one feature per table, named like it
            features = [Feature(t.name, t.name) for t in tables]
        features = list(features)
        if not features:
            raise ValueError("EmbeddingTables needs at least one Feature")
        names = [f.name for f in features]
        if len(set(names)) != len(names):
            raise ValueError(f"EmbeddingTables: feature names repeat in {names}")
        configs = []
        for f in features:
            if f.table not in by_name:
                raise ValueError(
                    f"feature {f.name!r} looks up table {f.table!r}, which is not declared; "
                    f"the tables are {list(by_name)}"
                )
            t = by_name[f.table]
            if f.pooling not in {p.value for p in Pooling}:
                raise ValueError(
                    f"feature {f.name!r}: pooling must be sum, mean or none (a sequence), "
                    f"not {f.pooling!r}"
                )
            configs.append(
                TableConfig(
                    f.name,
                    t.rows,
                    t.dim,
                    f.hotness,
                    Pooling(f.pooling),
                    f.jagged,
                    f.mean_ids,
                    None if f.table == f.name else f.table,
                    t.dynamic,
                )
            )
        unused = [t.name for t in tables if t.name not in {f.table for f in features}]
        if unused:
            raise ValueError(f"EmbeddingTables: no feature looks up table(s) {unused}")
        self.tables = tuple(tables)
        self.features = tuple(configs)  # one TableConfig per feature (hybridrec.types)
        self.storage: nn.Module | None = None
        self.plan: ShardingPlan | None = None  # how `storage` is sharded, once attached
        # the storage call, when it must differ from calling it (a plain function, never a
        # module: it would be registered twice)
        self._lookup: Callable[[torch.Tensor], Embedded] | None = None

    @classmethod
    def of(
        cls,
        features: Sequence[TableConfig],
        *,
        namespace: str | None = None,
        autocast_output: bool = False,
    ) -> EmbeddingTables:
        """A declaration of `features` (TableConfig per feature, as a dataset or
        ModelConfig.tables() gives them; features sharing a table name it once)."""
        tables: dict[str, Table] = {}
        for f in features:
            tables.setdefault(f.table_name, Table(f.table_name, f.num_rows, f.dim, f.dynamic))
        return cls(
            list(tables.values()),
            [
                Feature(f.name, f.table_name, f.hotness, f.pooling.value, f.jagged, f.mean_ids)
                for f in features
            ],
            namespace=namespace,
            autocast_output=autocast_output,
        )

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    def qualified(self, path: str) -> list[TableConfig]:
        """Its features as plans, checkpoints and exports name them, declared at module path
        `path`: "<namespace>.<feature>" looking up "<namespace>.<table>" (module docstring)."""
        ns = self.prefix(path)
        return [
            dataclasses.replace(f, name=qualify(ns, f.name), storage=qualify(ns, f.table_name))
            for f in self.features
        ]

    def prefix(self, path: str) -> str:
        """The namespace of its names when declared at module path `path`."""
        return path if self.namespace is None else self.namespace

    def select(self, ids: KeyedIds) -> torch.Tensor:
        """The columns of a batch's ids [B, H] that these features read, in their order
        ([B, sum of their hotness]); ValueError naming a missing or mis-sized feature."""
        return ids.select(self.feature_names, [f.hotness for f in self.features])

    def attach(self, storage: nn.Module, plan: ShardingPlan | None = None) -> None:
        """Give the declaration its rows: an embedding module over `self.features` (in order,
        names as given, or qualified by the caller) with forward(ids [B, H]) -> pooled, and
        the plan it follows."""
        self.storage, self.plan = storage, plan
        self._lookup = None

    def keep_lookup_eager(self) -> None:
        """Under torch.compile of the model, call the storage eagerly (a graph break): its
        backward updates rows and runs collectives, nothing a graph can hold."""
        storage = self.storage
        assert storage is not None, "attach storage first"

        def lookup(cols: torch.Tensor) -> Embedded:
            return storage(cols)

        self._lookup = torch.compiler.disable(lookup)

    @contextlib.contextmanager
    def lookup_through(self, lookup: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
        """Inside the block, the forward hands its columns [B, H] to `lookup` (a plain
        function returning what the storage would) instead of the storage: exact mode serves
        each micro-shard its rows of the step's one lookup this way (hybridrec.exact)."""
        saved, self._lookup = self._lookup, lookup
        try:
            yield
        finally:
            self._lookup = saved

    def forward(self, ids: KeyedIds | torch.Tensor) -> Pooled:
        if self.storage is None:
            raise RuntimeError(
                "these EmbeddingTables have no rows yet: call hybridrec.parallelize(model, ...) "
                "first (it plans and builds them, on one process or many)"
            )
        if isinstance(ids, KeyedIds):
            cols = self.select(ids)
        else:
            want = sum(f.hotness for f in self.features)
            if ids.dim() != 2 or ids.shape[1] != want:
                raise ValueError(
                    f"EmbeddingTables of features {list(self.feature_names)} takes KeyedIds, or "
                    f"ids [B, {want}] of exactly these features; got {list(ids.shape)}"
                )
            cols = ids
        if cols.dtype in NARROW_IDS:  # the storage's exchanges count and route in int64
            cols = cols.long()
        pooled = (self._lookup or self.storage)(cols)
        return Pooled(pooled, self.features, cols)


def qualify(namespace: str, name: str) -> str:
    """A declaration's table or feature as plans, checkpoints and exports name it."""
    return f"{namespace}.{name}" if namespace else name


def declared_tables(model: nn.Module) -> list[tuple[str, EmbeddingTables]]:
    """Every EmbeddingTables in `model`, with its module path ("" for the model itself), in
    module order (the order every rank sees)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, EmbeddingTables)]


def declared_features(model: nn.Module) -> list[TableConfig]:
    """Every declaration's features, qualified (EmbeddingTables.qualified), in module order:
    what plans, checkpoints and exports name."""
    return [f for path, t in declared_tables(model) for f in t.qualified(path)]
