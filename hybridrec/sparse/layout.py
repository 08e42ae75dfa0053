"""Where every shard of a plan lives and how one rank's pieces line up: pure, from the plan.

No process group and no tensors of weights: `ShardedLayout.build(tables, plan, rank)` gives
the index structures the sharded collection and its exchanges read, so they can be tested
on their own.

`tables` are the model's features (TableConfig, one per id column block of a batch); the plan
shards their storage tables (`storage`, hybridrec.types.storage_tables), which several features
may share. A *unit* is one feature's lookup in one non-replicated shard, served by the shard's
owner rank. A feature is 1 unit (table-wise), k units whose outputs are concatenated in column
order (column-wise), or k units whose outputs are summed in shard order (row-wise). A rank's
units are fused into one group per placement and width, named by a typed `GroupKey`
(`Placement.DEVICE`, `HOST` (prefetched a step ahead), `HOST_DYNAMIC` (dynamic tables in host
memory: their rows are known only after the map, so they are admitted at lookup) or
`REPLICATED` for data-parallel tables). A dynamic table's shard is a slot of its width's group
like any other: its owner maps the raw ids it receives to the slot's rows before the group's
lookup (hybridrec.sparse.dynamic.remap). Units
of rank q are listed group by group (in order of first appearance), each group's in (storage
table, shard, feature) order, so a group's units lie side by side in every exchange; the
output dist receives them in (source rank, that order), which `table_units` maps back to
features. A group stores each of
its shards once, as a *slot*: the units of features sharing a table read the same slot, so
their ids' gradients meet in one deduplication, as in the unsharded table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

import torch

from hybridrec.sparse.costs import id_wire_bytes
from hybridrec.types import (
    ShardingPlan,
    ShardSpec,
    TableConfig,
    TablePlan,
    hot_offsets,
    storage_index,
    storage_tables,
)


class Placement(str, Enum):
    """Where a fused group's rows live, and so how its lookup gets them."""

    DEVICE = "device"  # device memory: fixed and dynamic tables alike
    HOST = "host"  # host memory behind a device cache, its rows prefetched a step ahead
    HOST_DYNAMIC = "host_dynamic"  # the same for dynamic tables: rows known after the map only
    REPLICATED = "replicated"  # a data-parallel table's full copy on every rank


@dataclass(frozen=True, order=True)
class GroupKey:
    """A fused group of one rank: its placement and width (one group per pair; ordered by
    placement, then width, wherever ranks must agree on an order of groups)."""

    placement: Placement
    width: int

    @property
    def on_host(self) -> bool:
        return self.placement in (Placement.HOST, Placement.HOST_DYNAMIC)

    @property
    def prefetched(self) -> bool:
        """Its rows are admitted into its device cache a step ahead (prefetch)."""
        return self.placement is Placement.HOST

    def __str__(self) -> str:
        return f"{self.placement.value} w{self.width}"


@dataclass(frozen=True)
class Unit:
    """One feature's lookup in one non-replicated shard of the table it reads."""

    table_index: int  # the feature's index
    table: TableConfig  # the feature
    shard: ShardSpec
    row_wise: bool
    storage_index: int  # the table's index in the plan

    @property
    def slot(self) -> tuple[int, ShardSpec]:
        """The stored shard it reads: shared by the units of features sharing its table."""
        return (self.storage_index, self.shard)

    @property
    def counted(self) -> bool:
        """Its ids cross the input dist with one count per sample (a bag's ids here vary)."""
        return self.row_wise or self.table.jagged

    @property
    def dynamic(self) -> bool:
        """Its ids are raw (a dynamic table): its shard's owner maps them to rows."""
        return self.table.dynamic is not None

    @property
    def group_key(self) -> GroupKey:
        """The fused group serving it on its rank (see Placement)."""
        if not self.shard.on_host:
            return GroupKey(Placement.DEVICE, self.shard.width)
        placement = Placement.HOST_DYNAMIC if self.dynamic else Placement.HOST
        return GroupKey(placement, self.shard.width)

    @property
    def whole(self) -> bool:
        """The unit is its whole table (every row and column)."""
        s, t = self.shard, self.table
        return (
            s.row_start == 0 and s.row_end == t.num_rows and s.col_start == 0 and s.width == t.dim
        )


@dataclass(frozen=True)
class ShardedLayout:
    """One rank's view of a plan (see the module docstring for units and groups)."""

    tables: tuple[TableConfig, ...]  # the features
    plan: ShardingPlan  # over `storage`
    rank: int
    units_on: tuple[tuple[Unit, ...], ...]  # per rank: the units it serves
    table_units: dict[int, list[int]]  # feature -> positions in the received list, shard order
    dp_tables: tuple[int, ...]  # features of replicated tables, in feature order
    group_units: dict[GroupKey, list[int]]  # this rank's groups -> their local units, in order
    dp_group_tables: dict[GroupKey, list[int]]  # replicated groups -> their features
    peers: dict[int, list[int]]  # local column unit -> ranks of its table's other columns
    full_row_stat: bool
    storage: tuple[TableConfig, ...]  # the plan's tables
    storage_of: tuple[int, ...]  # feature -> its table's index in `storage`

    @staticmethod
    def build(
        tables: Sequence[TableConfig], plan: ShardingPlan, rank: int, full_row_stat: bool = False
    ) -> ShardedLayout:
        """`full_row_stat`: the optimizer keeps one statistic over a row's full width
        (row-wise Adagrad), so column units of one table must share theirs (`peers`)."""
        tables = tuple(tables)
        storage = storage_tables(tables)
        storage_of = tuple(storage_index(tables)[1])
        check_plan(storage, plan)
        users = [[f for f, j in enumerate(storage_of) if j == i] for i in range(len(storage))]
        units_on: list[list[Unit]] = [[] for _ in range(plan.world_size)]
        dp_tables = []
        for i, tp in enumerate(plan.tables):
            if tp.sharding.traits.replicated:
                dp_tables.extend(users[i])
                continue
            row_wise = tp.sharding.traits.partial_sums
            for s in tp.shards:
                units_on[s.rank].extend(Unit(f, tables[f], s, row_wise, i) for f in users[i])
        for q, units in enumerate(units_on):  # group by group, each keeping its units' order
            keys = list(dict.fromkeys(u.group_key for u in units))
            units_on[q] = sorted(units, key=lambda u: keys.index(u.group_key))
        dp_tables.sort()
        position = {}
        for u in (u for units in units_on for u in units):
            position[(u.table_index, u.shard)] = len(position)
        table_units = {
            f: [position[(f, s)] for s in plan.tables[i].shards]
            for f, i in enumerate(storage_of)
            if not plan.tables[i].sharding.traits.replicated
        }
        group_units: dict[GroupKey, list[int]] = {}
        for k, u in enumerate(units_on[rank]):
            group_units.setdefault(u.group_key, []).append(k)
        dp_group_tables: dict[GroupKey, list[int]] = {}
        for f in dp_tables:
            dp_group_tables.setdefault(GroupKey(Placement.REPLICATED, tables[f].dim), []).append(f)
        peers = {}
        if full_row_stat:
            for k, u in enumerate(units_on[rank]):
                tp = plan.tables[u.storage_index]
                if tp.sharding.traits.concatenated:
                    peers[k] = [s.rank for s in tp.shards if s.rank != rank]
        return ShardedLayout(
            tables,
            plan,
            rank,
            tuple(tuple(units) for units in units_on),
            table_units,
            tuple(dp_tables),
            group_units,
            dp_group_tables,
            peers,
            full_row_stat,
            storage,
            storage_of,
        )

    @property
    def world(self) -> int:
        return self.plan.world_size

    @property
    def local_units(self) -> tuple[Unit, ...]:
        return self.units_on[self.rank]

    @cached_property
    def group_slots(self) -> dict[GroupKey, list[tuple[int, ShardSpec]]]:
        """Group key -> the shards it stores (slots: (table index, shard)), in group order;
        replicated groups' slots are their whole tables."""
        out: dict[GroupKey, list[tuple[int, ShardSpec]]] = {}
        for key, ks in self.group_units.items():
            slots = out.setdefault(key, [])
            for k in ks:
                if self.local_units[k].slot not in slots:
                    slots.append(self.local_units[k].slot)
        for key, fs in self.dp_group_tables.items():
            slots = out.setdefault(key, [])
            for f in fs:
                i = self.storage_of[f]
                slot = (i, self.plan.tables[i].shards[self.rank])
                if slot not in slots:
                    slots.append(slot)
        return out

    def slot_rows(self, key: GroupKey) -> list[int]:
        """Where each slot of group `key` starts in the group's rows, and the group's rows."""
        out = [0]
        for _, shard in self.group_slots[key]:
            out.append(out[-1] + shard.num_rows)
        return out

    def locate(self, table_index: int) -> tuple[GroupKey, int]:
        """The group key and slot position in that group of this rank's first shard of a
        (storage) table (KeyError where this rank holds none of it)."""
        for key, slots in self.group_slots.items():
            for pos, (i, _) in enumerate(slots):
                if i == table_index:
                    return key, pos
        raise KeyError(f"rank {self.rank} holds no shard of table {table_index}")

    def input_slots(self, key: GroupKey) -> list[int]:
        """Per input of group `key` (its units, or its replicated features): its slot's
        position in `group_slots[key]`."""
        slots = self.group_slots[key]
        if key.placement is Placement.REPLICATED:
            plan = self.plan.tables
            return [
                slots.index((self.storage_of[f], plan[self.storage_of[f]].shards[self.rank]))
                for f in self.dp_group_tables[key]
            ]
        return [slots.index(self.local_units[k].slot) for k in self.group_units[key]]

    @cached_property
    def offsets(self) -> list[int]:
        """Column offsets of each table's ids in a batch's ids [B, H]."""
        return hot_offsets(self.tables)

    @cached_property
    def dp_columns(self) -> dict[int, tuple[int, int]]:
        """Replicated table -> its columns [a, b) in the replicated tables' [B_l, sum D]
        (a sequence's rows side by side: slots * D columns)."""
        out, a = {}, 0
        for i in self.dp_tables:
            width = self.tables[i].dim * self.tables[i].slots
            out[i] = (a, a + width)
            a += width
        return out

    @cached_property
    def one_width(self) -> bool:
        """Every table has the same width: the pooled output is [B, T, D], else [B, sum D]."""
        return len({t.dim for t in self.tables}) == 1

    @cached_property
    def sequences(self) -> bool:
        """Some feature is a sequence (Pooling.NONE): its output is a row per position."""
        return any(t.sequence for t in self.tables)

    @cached_property
    def id_dtype(self) -> torch.dtype:
        """Ids cross the input dist as int32 where every table's ids fit (half the bytes)."""
        return torch.int32 if id_wire_bytes(self.tables) == 4 else torch.int64

    @cached_property
    def has_counted(self) -> bool:
        """Some unit's payload varies per batch: the input dist first exchanges its sizes."""
        return any(u.counted for units in self.units_on for u in units)

    @cached_property
    def dynamic(self) -> bool:
        """Some table is dynamic (its ids are raw, mapped to rows by its shards' owners)."""
        return any(t.dynamic is not None for t in self.storage)

    @cached_property
    def has_host(self) -> bool:
        """Host-resident shards on any rank: every rank then joins the prefetch exchange."""
        return any(s.on_host for tp in self.plan.tables for s in tp.shards)

    @cached_property
    def replicated_tables(self) -> set[str]:
        return {self.tables[i].name for i in self.dp_tables}

    @cached_property
    def exchange_row_stats(self) -> bool:
        """Column units share row statistics (on every rank: it is a collective)."""
        return self.full_row_stat and any(
            tp.sharding.traits.concatenated for tp in self.plan.tables
        )

    @cached_property
    def whole_values(self) -> bool:
        return whole_values(self.plan)

    @cached_property
    def sample_major_group(self) -> GroupKey | None:
        """The one group that holds every table whole, on one rank with no replicated tables:
        its lookup can number its bags sample-major with nothing to exchange
        (hybridrec.sparse.exchange.sample_major). None otherwise."""
        if self.world != 1 or self.dp_tables or len(self.group_units) != 1:
            return None
        [(key, ks)] = self.group_units.items()
        units = [self.local_units[k] for k in ks]
        if all(u.whole for u in units) and sorted(u.table_index for u in units) == list(
            range(len(self.tables))
        ):
            return key  # one unit per feature (features sharing a table read one slot)
        return None

    def dynamic_slots(self, key: GroupKey) -> list[int]:
        """The positions in `group_slots[key]` of its dynamic tables' shards."""
        return [p for p, (i, _) in enumerate(self.group_slots[key]) if self.storage[i].dynamic]


def full_shard(table: TableConfig, rank: int = 0) -> ShardSpec:
    """The one shard of a table held whole by `rank`."""
    return ShardSpec(table.name, rank, 0, table.num_rows, 0, table.dim)


def whole_values(plan: ShardingPlan) -> bool:
    """Whether every value the output dist carries is a whole pooled value: no table is
    split by rows (whose partial sums must be added in fp32 before any rounding)."""
    return all(len(tp.shards) == 1 or not tp.sharding.traits.partial_sums for tp in plan.tables)


def check_plan(tables: Sequence[TableConfig], plan: ShardingPlan) -> None:
    """The plan must cover exactly these (storage) tables, in order."""
    names = [tp.table for tp in plan.tables]
    if names != [t.name for t in tables]:
        raise ValueError(f"plan tables {names} do not match the model's {[t.name for t in tables]}")
    world = plan.world_size
    for t, tp in zip(tables, plan.tables, strict=True):
        if t.dynamic is not None:
            check_dynamic_plan(t, tp)
        if tp.sharding.traits.replicated:
            if sorted(s.rank for s in tp.shards) != list(range(world)):
                raise ValueError(f"data-parallel table {t.name} needs one shard on every rank")
            continue
        cells = sum(s.num_rows * s.width for s in tp.shards)
        if cells != t.num_rows * t.dim:
            raise ValueError(
                f"shards of table {t.name} cover {cells} cells, not {t.num_rows}x{t.dim}"
            )
        if tp.sharding.traits.concatenated:
            starts = [s.col_start for s in tp.shards]
            if starts != sorted(starts):
                raise ValueError(f"column shards of table {t.name} must be in column order")


def check_dynamic_plan(table: TableConfig, tp: TablePlan) -> None:
    """A dynamic table is never replicated, and its row ranges own whole buckets."""
    assert table.dynamic is not None
    if tp.sharding.traits.replicated:
        raise ValueError(
            f"dynamic table {table.name!r} cannot be data_parallel (replicas would admit ids "
            "apart); shard it table_wise, column_wise or row_wise"
        )
    size = table.num_rows // table.dynamic.buckets
    for s in tp.shards:
        if s.row_start % size or s.row_end % size:
            raise ValueError(
                f"dynamic table {table.name!r}: shard rows [{s.row_start}, {s.row_end}) split a "
                f"bucket of {size} rows; row-wise shards must own whole buckets"
            )
