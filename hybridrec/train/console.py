"""What a run tells its user: loggers, the progress bar, the lines logged per train row,
eval and end of run, and the derived rates of the embedding modules' counters."""

from __future__ import annotations

import dataclasses
import logging
import re
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hybridrec.config import Config
from hybridrec.distributed.comm import all_reduce_sum
from hybridrec.distributed.env import DistEnv
from hybridrec.sparse.api import EmbeddingCounters
from hybridrec.sparse.dynamic.stats import DynamicStats
from hybridrec.sparse.host.stats import CacheStats
from hybridrec.train.loggers import JsonlLogger, MultiLogger, NullLogger, WandbLogger
from hybridrec.types import ShardingPlan

log = logging.getLogger("hybridrec")

EMBEDDING_PHASES = ("input_dist", "dynamic_map", "lookup", "output_dist", "data_parallel")


def build_loggers(
    cfg: Config, env: DistEnv, run_dir: Path, wandb_run_id: str | None = None
) -> NullLogger:
    if not env.is_main:
        return NullLogger()
    loggers: list[NullLogger] = [JsonlLogger(run_dir / "metrics.jsonl")]
    if cfg.logger.name == "wandb":
        loggers.append(
            WandbLogger(
                run_dir,
                cfg.logger.project,
                cfg.logger.mode,
                dataclasses.asdict(cfg),
                cfg.logger.entity,
                list(cfg.logger.tags),
                wandb_run_id,
            )
        )
    return MultiLogger(loggers)


def progress_bar(cfg: Config, env: DistEnv) -> tqdm | None:
    """A bar on rank 0 when asked for (train.progress=bar) or on a terminal (auto)."""
    mode = cfg.train.progress
    use_bar = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
    if not env.is_main or not use_bar:
        return None
    return tqdm(total=cfg.train.steps, desc="train", unit="step", dynamic_ncols=True)


def plan_rows(plan: ShardingPlan) -> list[list[str]]:
    """The plan as table rows (table, sharding, shards, reason) for the loggers."""
    return [
        [
            tp.table,
            tp.sharding.value,
            " ".join(
                f"{s.rank}:r{s.row_start}-{s.row_end}c{s.col_start}-{s.col_end}" for s in tp.shards
            ),
            tp.reason,
        ]
        for tp in plan.tables
    ]


def phase_columns(phases: dict[str, float]) -> dict[str, float]:
    """Per-phase ms/step as logged: the forward less its embedding phases is `dense_forward`."""
    emb = sum(phases.get(k, 0.0) for k in EMBEDDING_PHASES)
    if "forward" in phases:
        phases["dense_forward"] = max(phases.pop("forward") - emb, 0.0)
    return {f"time_ms/{k}": v for k, v in sorted(phases.items())}


def cache_rates(cache: CacheStats | None, steps: int, world: int) -> dict[str, float]:
    """Host caches over all ranks (counters summed) -> hit rate, rows moved per step (in and
    out), copy bandwidth and time the steps waited on host memory. {} without caches."""
    if cache is None:
        return {}
    c = cache
    return {
        "cache/hit_rate": c.hits / c.rows_requested if c.rows_requested else 1.0,
        "cache/rows_in_per_step": c.rows_loaded / steps,
        "cache/rows_out_per_step": c.rows_written / steps,
        "cache/copy_gb_s": c.bytes_moved / c.transfer_s / 1e9 if c.transfer_s else 0.0,
        "time_ms/host_wait": c.wait_s / world / steps * 1e3,
    }


def dynamic_rates(tables: dict[str, DynamicStats], steps: int) -> dict[str, float]:
    """Dynamic tables over all ranks (each table's DynamicStats summed, see
    hybridrec.sparse.dynamic.stats) -> per table: occupancy (share of the slots ids may take
    that hold one), ids admitted and evicted per step since the last row, and in all. {}
    without dynamic tables."""
    out = {}
    for t in sorted(tables):
        c, p = tables[t], f"dynamic/{t}/"
        out[p + "occupancy"] = c.occupancy
        out[p + "admitted_per_step"] = c.admitted / max(steps, 1)
        out[p + "evicted_per_step"] = c.evicted / max(steps, 1)
        out[p + "admitted"] = c.admitted_total
        out[p + "evicted"] = c.evicted_total
    return out


def unknown_rates(tables: dict[str, DynamicStats]) -> dict[str, float]:
    """Per dynamic table, the share of ids looked up in evaluation that had no row:
    `dynamic/<table>/unknown_rate` ({} without dynamic tables)."""
    return {f"dynamic/{t}/unknown_rate": tables[t].unknown_rate for t in sorted(tables)}


def summed_counters(taken: list[EmbeddingCounters], env: DistEnv) -> EmbeddingCounters:
    """The embedding modules' counters (what take_metrics or take_eval_unknown gave), summed
    over modules and ranks (a collective when they have counters: every rank has the same)."""
    total = EmbeddingCounters()
    for counters in taken:
        total.add(counters)
    values = total.values()
    if values and env.group is not None:
        v = torch.tensor(values, dtype=torch.float64, device=env.device)
        all_reduce_sum(v, env.group, name="embedding_counters")
        total = total.with_values(v.tolist())
    return total


def memory_gb(device: torch.device) -> float:
    """Peak device memory (CUDA) or peak resident memory of this process (CPU), in GB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def show_train(row: dict[str, Any], steps: int, bar: tqdm | None) -> None:
    """A train row on the bar's postfix, or as one log line."""
    cache = ""
    if "cache/hit_rate" in row:  # host-resident tables: how the cache does
        cache = (
            f"  cache hit {row['cache/hit_rate']:.3f}, "
            f"{row['cache/rows_in_per_step']:,.0f} rows in / "
            f"{row['cache/rows_out_per_step']:,.0f} out per step, "
            f"waited {row['time_ms/host_wait']:.2f} ms/step"
        )
    for key in sorted(k for k in row if k.endswith("/occupancy")):  # dynamic tables
        t = key.split("/")[1]
        cache += (
            f"  {t} {100 * row[key]:.0f}% full, {row[f'dynamic/{t}/admitted_per_step']:,.1f} in"
            f" / {row[f'dynamic/{t}/evicted_per_step']:,.1f} out per step"
        )
    if bar is not None:
        postfix = {"loss": f"{row['loss']:.4f}", "sps": f"{row['samples_per_sec']:,.0f}"}
        if cache:
            postfix["hit"] = f"{row['cache/hit_rate']:.3f}"
        bar.set_postfix(postfix)
        return
    log.info(
        "step %d/%d  loss %.5f  %.0f samples/s%s",
        row["step"],
        steps,
        row["loss"],
        row["samples_per_sec"],
        cache,
    )


# The eval metrics a log line shows, in order, with their digits; a task logs its own subset
TOPK = re.compile(r"(sampled_)?(hr|recall|ndcg)@\d+$")
EVAL_LINE = (
    ("auc", 4),
    ("logloss", 4),
    ("ne", 4),
    ("calibration", 3),
    ("accuracy", 4),
    ("rmse", 4),
    ("mae", 4),
    ("loss", 4),
)


def eval_text(metrics: dict[str, float], keys: tuple[str, ...] | None = None) -> str:
    """'auc 0.7812  logloss 0.4521 ...': the metrics present (of `keys`, default all)."""
    shown = [(k, d) for k, d in EVAL_LINE if k in metrics and (keys is None or k in keys)]
    # retrieval's top-K metrics (hr@10, ndcg@10, ...), in their order; `keys` names a kind
    shown += [
        (k, 4) for k in metrics if TOPK.match(k) and (keys is None or k.split("@")[0] in keys)
    ]
    return "  ".join(f"{k} {metrics[k]:.{d}f}" for k, d in shown)


def show_eval(step: int, metrics: dict[str, float], split: str) -> None:
    log.info(
        "eval @ step %d  %s  (%d samples of split %r)",
        step,
        eval_text(metrics),
        metrics["eval_samples"],
        split,
    )


def show_summary(
    cfg: Config, result: dict[str, Any], steps: int, wall_s: float, run_dir: Path | None
) -> None:
    """One closing line: what was trained, the last eval, and where the results are."""
    parts = [
        f"done: {steps} steps in {wall_s:.1f} s "
        f"({steps * cfg.train.batch_size / wall_s:,.0f} samples/s with eval and saves)"
    ]
    ev = result.get("eval") or {}
    if ev:
        keys = ("auc", "ne", "rmse", "mae", "hr", "ndcg", "sampled_hr", "sampled_ndcg")
        parts.append("eval " + eval_text(ev, keys))
    if run_dir is not None:
        parts.append(f"metrics {run_dir / 'metrics.jsonl'} (hybridrec-plot {run_dir})")
    if cfg.checkpoint.dir:
        parts.append(f"checkpoints in {cfg.checkpoint.dir}")
    log.info("; ".join(parts))


def show_start(cfg: Config, env: DistEnv, step: int, local_batch: int) -> None:
    """What the run is about to train (and that there is nothing left, when so)."""
    steps = cfg.train.steps
    log.info(
        "training steps %d..%d, global batch %d (%d per rank x %d ranks) on %s",
        step + 1,
        steps,
        cfg.train.batch_size,
        local_batch,
        env.world_size,
        env.device,
    )
    if step >= steps:
        log.info(
            "the run is already at step %d >= train.steps=%d: nothing to train (raise "
            "train.steps to continue, train.count_from=resume to count train.steps or "
            "train.epochs from the resumed step, or eval.only=true to evaluate it)",
            step,
            steps,
        )
