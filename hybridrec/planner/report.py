"""The plan as a fixed-width table a person can read: tables first, then ranks, then one line.

Memory is shown in binary units (GiB = 2**30 bytes, as memory is sized), traffic per step in
decimal ones (MB = 10**6 bytes, as links are rated), times in ms; each column block uses the
largest unit its biggest number reaches. Shards are written compactly as
``rank:rows[a:b]xcols[c:d]``, leaving out a full dimension: ``3:all`` (a whole table on
rank 3), ``1:cols[0:64]``, ``0:rows[0:500]``, ``0-7:all`` (replicated); a host-resident shard
adds its device cache: ``0:all@host(cache 1.99M)``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from hybridrec.planner.cost import PlanCost
from hybridrec.planner.types import GIB, human_bytes
from hybridrec.types import ShardingPlan, ShardSpec, TableConfig, TablePlan, storage_tables

SHARDS_WIDTH = 44  # the shards column wraps onto continuation lines past this width


MEMORY_UNITS = (("GiB", float(GIB)), ("MiB", float(1 << 20)), ("KiB", 1024.0), ("B", 1.0))
TRAFFIC_UNITS = (("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0))


def _unit(values: Sequence[float], units: Sequence[tuple[str, float]]) -> tuple[str, float]:
    """The largest unit that the largest value reaches, so one table column shares one unit."""
    top = max(values, default=0)
    for name, scale in units:
        if top >= scale:
            return name, scale
    return units[-1]


def _count(n: float) -> str:
    """1_234_567 -> '1.23M' (decimal, for counts of rows and lookups)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _shard(s: ShardSpec, table: TableConfig) -> str:
    parts = []
    if (s.row_start, s.row_end) != (0, table.num_rows):
        parts.append(f"rows[{s.row_start}:{s.row_end}]")
    if (s.col_start, s.col_end) != (0, table.dim):
        parts.append(f"cols[{s.col_start}:{s.col_end}]")
    where = f"@host(cache {_count(s.cache_rows)})" if s.on_host else ""
    return f"{s.rank}:{'x'.join(parts) or 'all'}{where}"


def _shards(tp: TablePlan, table: TableConfig, world: int) -> str:
    ranks = [s.rank for s in tp.shards]
    if tp.sharding.traits.replicated and ranks == list(range(world)) and world > 1:
        return f"0-{world - 1}:all"
    return " ".join(_shard(s, table) for s in tp.shards)


def _render(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    right: Sequence[bool],
    wrap: dict[int, int] | None = None,
) -> list[str]:
    """Fixed-width columns; cells of the columns in `wrap` (index -> width) wrap onto more lines."""
    wrap = wrap or {}
    cells = [
        [
            textwrap.wrap(c, wrap[i], break_long_words=False, break_on_hyphens=False) or [""]
            if i in wrap
            else [c]
            for i, c in enumerate(row)
        ]
        for row in rows
    ]
    widths = [len(h) for h in header]
    for row in cells:
        for i, lines in enumerate(row):
            widths[i] = max(widths[i], *(len(line) for line in lines))

    def line(values: Sequence[str]) -> str:
        out = [
            v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right, strict=True)
        ]
        return "  ".join(out).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths)]
    for row in cells:
        for k in range(max(len(lines) for lines in row)):
            out.append(line([lines[k] if k < len(lines) else "" for lines in row]))
    return out


def _hotness(t: TableConfig) -> str:
    """Ids per bag: '3', or for a list feature '0..6' with its mean when known."""
    if not t.jagged:
        return str(t.hotness)
    mean = f" ({t.mean_ids:.1f})" if t.mean_ids is not None else ""
    return f"0..{t.hotness}{mean}"


def format_plan(plan: ShardingPlan, cost: PlanCost, tables: Sequence[TableConfig]) -> str:
    """The plan and its cost as text: one row per table, one row per rank, one summary line."""
    by_name = {t.name: t for t in storage_tables(tables)}
    users: dict[str, list[str]] = {}
    for f in tables:
        users.setdefault(f.table_name, []).append(f.name)
    table_rows = []
    for tp in plan.tables:
        t = by_name[tp.table]
        shared = users.get(t.name, [t.name])
        table_rows.append(
            [
                t.name if shared == [t.name] else f"{t.name} ({', '.join(shared)})",
                _count(t.num_rows),
                str(t.dim),
                _hotness(t),
                tp.sharding.value,
                _shards(tp, t, plan.world_size),
                tp.reason,
            ]
        )
    part1 = _render(
        ["table", "rows", "dim", "hot", "sharding", "shards", "reason"],
        table_rows,
        [False, True, True, True, False, False, False],
        wrap={5: SHARDS_WIDTH},
    )

    ranks = cost.ranks
    mem_unit, mem_scale = _unit([r.total_bytes for r in ranks], MEMORY_UNITS)
    net_unit, net_scale = _unit(
        [
            v
            for r in ranks
            for v in (r.ids_sent_bytes, r.ids_recv_bytes, r.emb_sent_bytes, r.emb_recv_bytes)
        ],
        TRAFFIC_UNITS,
    )
    gib = lambda n: f"{n / mem_scale:.2f}"
    mb = lambda n: f"{n / net_scale:.1f}"
    ms = lambda s: f"{s * 1e3:.3f}"
    rank_rows = [
        [
            str(r.rank),
            str(r.num_shards),
            gib(r.weight_bytes),
            gib(r.optimizer_bytes),
            gib(r.buffer_bytes),
            gib(r.total_bytes),
            human_bytes(cost.budget_bytes),  # its own unit: 16 GiB in KiB reads badly
            f"{mb(r.ids_sent_bytes)}/{mb(r.ids_recv_bytes)}",
            f"{mb(r.emb_sent_bytes)}/{mb(r.emb_recv_bytes)}",
            _count(r.lookups_per_step),
            ms(r.input_dist_s),
            ms(r.lookup_s),
            ms(r.output_dist_s),
            ms(r.backward_s),
            ms(r.total_s),
        ]
        for r in ranks
    ]
    part2 = _render(
        [
            "rank",
            "shards",
            "weights",
            "opt",
            "buffers",
            "total",
            "budget",
            f"ids {net_unit} s/r",
            f"emb {net_unit} s/r",
            "lookups",
            "in ms",
            "lookup ms",
            "out ms",
            "bwd ms",
            "total ms",
        ],
        rank_rows,
        [True] * 15,
    )
    return "\n".join(
        [
            f"sharding plan for {plan.world_size} ranks (fingerprint {plan.fingerprint()})",
            "",
            *part1,
            "",
            f"per rank: memory in {mem_unit}, traffic in {net_unit} per step sent/received "
            "(forward; backward mirrors it), estimated ms per phase",
            *part2,
            "",
            cost.summary(),
        ]
    )
