"""Device-cache hit rate and rows moved for host-memory tables (sharding=host), on the CPU.

    # the 1TB model as benchmarks/host_cache.py runs it on the H100 (12 GiB of cache)
    python -m benchmarks.cache_policy --model dlrm_1tb --cache-gb 12 --optimizer rowwise_adagrad
    # the Kaggle model, cache sizes side by side
    python -m benchmarks.cache_policy --model dlrm_kaggle --cache-fraction 0.01,0.05,0.1
    # any training data: extra arguments are Hydra overrides
    python -m benchmarks.cache_policy --model criteo_sample --cache-fraction 0.05 data=criteo_sample

What the cache serves depends only on the ids, the cache's size in rows and its policy, not on
the row values or the device. So this replays training batches through the real
HostCachedEmbedding on the CPU with 1-wide rows (the 1TB model's 188M rows then take 1.5 GB
instead of 96 GB), with the cache sizes the planner gives the real model (its width and
optimizer state per row, `sharding.cache_*`), stepping as the trainer does: warm start from the
data's id counts when it has them (a manifest's counts; synthetic data knows its popularity),
lookup, prefetch of the next batch, backward with an update (rows turn dirty and are written
back when evicted). `--cold` starts with an empty cache instead.

Per cache size, after `--warmup` steps: the hit rate over each batch's distinct rows, rows
loaded and written back per step, and the bytes those rows need at the real row width, with
the time they would take at an H100's sorted unified-addressing gather rate (66M rows/s,
hybridrec.kernels.host_copy's kernel; a model, not a measurement). `--cycle N` replays only N
distinct batches, as a benchmark that cycles pre-staged batches does: once the cache holds
them all it hits rows it has already seen, which a real data stream would not.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import command_line, compose_config, hardware, markdown_table
from hybridrec.builder import make_plan
from hybridrec.config import Config
from hybridrec.data import build_source
from hybridrec.optim import SparseSGD
from hybridrec.planner import OptimizerFootprint, cache_row_bytes
from hybridrec.sparse.bags import regular_bags
from hybridrec.sparse.fused import LookupInput
from hybridrec.sparse.host import HostCachedEmbedding
from hybridrec.types import ShardSpec, TableConfig, hot_offsets

UVA_SORTED_ROWS_S = 66e6  # H100, gather of sorted rows from pinned host memory (a model rate)


def make_cfg(args: argparse.Namespace, size: str) -> Config:
    overrides = [
        f"model={args.model}",
        "sharding=host",
        f"train.batch_size={args.batch_size}",
        f"optim.sparse.name={args.optimizer}",
        "device=cpu",
        *args.overrides,
    ]
    if args.cache_gb:
        overrides.append(f"sharding.cache_gb={size}")
    else:
        overrides.append(f"sharding.cache_fraction={size}")
    return compose_config(overrides)


def narrow_group(cfg: Config) -> tuple[HostCachedEmbedding, list[TableConfig]]:
    """The one-rank host group of the real plan, with 1-wide rows and the real cache rows."""
    plan = make_plan(cfg, 1)
    tables = cfg.model.tables()
    shards, cache_rows = [], 0
    for i, (t, tp) in enumerate(zip(tables, plan.tables, strict=True)):
        (s,) = tp.shards  # sharding=host on one rank: the whole table, one cached shard
        narrow = TableConfig(t.name, t.num_rows, 1, t.hotness, t.pooling)
        shards.append((narrow, i, ShardSpec(t.name, 0, 0, t.num_rows, 0, 1)))
        cache_rows += s.cache_rows
    group = HostCachedEmbedding(
        shards,
        SparseSGD(0.01),
        cache_rows,
        pin=False,
        age_every=cfg.sharding.cache_halflife,
        copy="staged",
    )
    return group, tables


def best_static_hit(counts, tables: list[TableConfig], batch: int, capacity: int) -> float:  # noqa: ANN001
    """Expected hit rate over a batch's distinct rows of the best fixed set of `capacity`
    rows, from the id counts (ids drawn independently): a row a table looks up with
    probability p per id is in a batch with probability 1 - (1 - p)^(batch * hotness)."""
    q = []
    for t, table in enumerate(tables):
        c = torch.from_numpy(counts(t)).double()
        p = (c / c.sum()).clamp(max=1 - 1e-12)
        q.append(-torch.expm1(batch * table.hotness * torch.log1p(-p)))
    q = torch.cat(q).numpy()
    k = min(capacity, q.size)
    return float(np.partition(q, q.size - k)[q.size - k :].sum() / q.sum())


def replay(
    cfg: Config,
    args: argparse.Namespace,
    cold: bool,
    share: float | None = None,
    halflife: int | None = None,
) -> dict:
    group, tables = narrow_group(cfg)
    if share is not None:
        group.evict_share = share
    if halflife is not None:
        group.age_every = halflife
    source = build_source(cfg)
    offsets = hot_offsets(tables)
    b = args.batch_size
    total = args.warmup + args.steps
    distinct = args.cycle or total

    def inputs(step: int) -> tuple:
        """The group's lookup of batch `step`: (rows, bags, scale, bags per table)."""
        ids = source.batch(step % distinct, b).ids
        per_table = []
        for t, table in enumerate(tables):
            col = ids[:, offsets[t] : offsets[t + 1]].reshape(-1)
            per_table.append(LookupInput(col, regular_bags(b, table.hotness, col.device), b))
        return group.flatten(per_table)

    start = time.perf_counter()
    counts = getattr(source, "id_counts", None)
    if counts is not None and not cold:  # as the trainer: the hottest rows first
        freq = torch.cat([torch.from_numpy(counts(t)).double() for t in range(len(tables))])
        group.warm_start(freq, b * sum(t.hotness for t in tables))
    current, prefetched = inputs(0), None
    for step in range(total):
        if step == args.warmup:
            group.take_stats()
            selections = group.evictions
        rows, bags, scale, sizes = current
        out = group.lookup(rows, bags, scale, sum(sizes), prefetched=prefetched)
        upcoming = inputs(step + 1)
        # as the trainer: the next batch's rows, before backward; its lookup takes them
        prefetched = group.prefetch(upcoming[0])
        out.sum().backward()
        current = upcoming
    st = group.take_stats()
    selections = (group.evictions - selections) / args.steps
    width = tables[0].dim
    footprint = OptimizerFootprint.for_optimizer(cfg.optim.sparse.name)
    row_bytes = cache_row_bytes(width, footprint, 4 if cfg.model.table_dtype == "fp32" else 2)
    rows_in, rows_out = st.rows_loaded / args.steps, st.rows_written / args.steps
    return {
        "cache_rows": group.capacity,
        "cache_pct": 100 * group.capacity / group.num_rows,
        "cache_gib": group.capacity * row_bytes / 2**30,
        "share": group.evict_share,
        "halflife": group.age_every,
        "selections": selections,
        "hit": st.hits / max(1, st.rows_requested),
        "distinct": st.rows_requested / args.steps,
        "in": rows_in,
        "out": rows_out,
        "mb": (rows_in + rows_out) * row_bytes / 1e6,
        "ms": 1e3 * (rows_in + rows_out) / UVA_SORTED_ROWS_S,
        "wall": time.perf_counter() - start,
        "best": (f"{best_static_hit(counts, tables, b, group.capacity):.3f}" if counts else "-"),
    }


def _row(r: dict, start: str) -> list[str]:
    return [
        f"{r['cache_rows']:,} ({r['cache_pct']:.2f}%, {r['cache_gib']:.2f} GiB)",
        start,
        f"{r['halflife']}",
        f"{r['share']:.4g}",
        f"{r['selections']:.2f}",
        f"{r['hit']:.3f}",
        r["best"],
        f"{r['distinct']:,.0f}",
        f"{r['in']:,.0f}",
        f"{r['out']:,.0f}",
        f"{r['mb']:,.0f}",
        f"{r['ms']:.2f}",
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dlrm_kaggle")
    p.add_argument("--batch-size", type=int, default=65536)
    p.add_argument("--optimizer", default="rowwise_adagrad", help="sizes the cache rows")
    p.add_argument("--cache-fraction", default="0.05", help="comma-separated fractions")
    p.add_argument("--cache-gb", default=None, help="comma-separated GiB (overrides fractions)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument(
        "--start",
        default="warm",
        help="warm (from the data's id counts, as training does), cold (empty), or warm,cold",
    )
    p.add_argument("--cycle", type=int, default=0, help="distinct batches, cycled (0: all new)")
    p.add_argument(
        "--halflife",
        default=None,
        help="comma-separated steps after which use counts halve (default: the config's "
        "sharding.cache_halflife)",
    )
    p.add_argument(
        "--evict-share",
        default=None,
        help="comma-separated least shares of the cache an eviction frees (default: the "
        "cache's, 1/64): more means fewer selections over the cache but a lower hit rate",
    )
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data=criteo_sample")
    args = p.parse_args(argv)
    sizes = (args.cache_gb or args.cache_fraction).split(",")
    rows = []
    starts = args.start.split(",")
    if set(starts) - {"warm", "cold"}:
        p.error(f"--start: warm, cold or warm,cold, got {args.start!r}")
    shares = [float(x) for x in args.evict_share.split(",")] if args.evict_share else [None]
    halflives = [int(x) for x in args.halflife.split(",")] if args.halflife else [None]
    for size in sizes:
        for start in starts:
            for share in shares:
                for halflife in halflives:
                    cfg = make_cfg(args, size)
                    r = replay(cfg, args, start == "cold", share, halflife)
                    rows.append(_row(r, start))
                    print("  ".join(rows[-1]), f"({r['wall']:.0f} s)", flush=True)
    headers = [
        "cache rows",
        "start",
        "halflife",
        "evict share",
        "selections/step",
        "hit rate",
        "best static",
        "distinct rows/step",
        "rows in/step",
        "rows out/step",
        "MB moved/step",
        "ms/step at 66M rows/s",
    ]
    table = markdown_table(headers, rows)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            f"# Host cache: hit rate and rows moved (replayed on the CPU)\n\n"
            f"Command: `{command_line()}`\n\n- Hardware: {hardware()}\n"
            f"- Model `{args.model}`, batch {args.batch_size}, cache sized for "
            f"{args.optimizer}; {args.steps} steps after {args.warmup} warmup, "
            f"{'every batch new' if not args.cycle else f'{args.cycle} batches cycled'}; "
            "start: warm = the cache warm-started from the data's id counts as training does, "
            "cold = empty; "
            f"next batch prefetched as the trainer does.\n"
            "- halflife: steps after which the cache's use counts halve "
            "(sharding.cache_halflife).\n"
            "- evict share: the least share of the cache an eviction frees (victims beyond the "
            "misses join the free slots); selections/step: how often a step selected victims "
            "(a top-k over the whole cache on the device).\n"
            "- best static: the expected hit rate of the best fixed set of rows of the same size, "
            "from the data's id counts (an upper bound for a stream without drift).\n"
            "- Hit rate and rows are measured (device-independent); the last column is a "
            "model: (rows in + out) / 66M rows/s, the H100's sorted UVA gather.\n\n"
            f"{table}\n"
        )


if __name__ == "__main__":
    main()
