"""`hybridrec-plot`: learning curves of runs and sweeps, from their metrics.jsonl, in one PNG.

    hybridrec-plot outputs/2026-11-23/10-00-00      # one run: writes <run dir>/curves.png
    hybridrec-plot multirun/2026-11-23/10-00-00     # every job of a sweep: <sweep dir>/curves.png
    hybridrec-plot runA runB -o ab.png --metrics loss,val/auc --smooth 20

One panel per metric, one line per run, against the training step. A metric is split/key
(train/loss, val/auc, test/hr@10) or a bare key (its usual split); the default draws the
logged ones of the train loss, the val split's AUC and log loss (binary), RMSE and MAE
(regression), HR@K and NDCG@K (retrieval, each K logged), and samples/s. Files written
before evaluation rows were named by their split ("eval") read as val. A sweep's jobs are
labelled by the overrides that differ between them (from their job.json). The PNG goes into
the run's (or sweep's) own directory as curves.png unless -o names another path; several
paths need -o. The plotted points also go to a CSV beside the PNG (run, metric, step,
value), for other tools; both are written atomically and the command prints where. Needs
matplotlib (`pip install 'hybridrec[plot]'`).
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrec.train.loggers import LEGACY_EVAL, read_metrics, row_split
from hybridrec.train.sweep import common_overrides, job_records

log = logging.getLogger("hybridrec")

METRICS_FILE = "metrics.jsonl"
PNG_NAME = "curves.png"  # in the run's or sweep's directory, unless -o says otherwise
# those logged (binary runs: AUC and log loss; regression: RMSE and MAE; retrieval: HR@K and
# NDCG@K, "val/hr@K" standing for each K logged) are drawn by default
DEFAULT_METRICS = (
    "train/loss",
    "val/auc",
    "val/logloss",
    "val/rmse",
    "val/mae",
    "val/hr@K",
    "val/ndcg@K",
    "train/samples_per_sec",
)
SPLITS = ("train", "val", "test")
# a bare key means the split it is logged under
_SPLIT_OF = {k: "val" for k in ("auc", "logloss", "accuracy", "ne", "calibration", "rmse", "mae")}
_TOPK = re.compile(r"(hr|recall|ndcg)@\d+$")


class PlotError(ValueError):
    """Bad input to hybridrec-plot: the message names the path, line or metric."""


@dataclass
class Run:
    label: str
    path: Path  # its metrics.jsonl
    rows: list[dict[str, Any]] = field(default_factory=list)


def _sweep_jobs(sweep: Path) -> list[Run]:
    """A sweep directory's jobs that logged metrics, labelled by the overrides that tell
    them apart (as the sweep summary does), else by their directory."""
    jobs = [j for j in job_records(sweep) if (sweep / j["dir"] / METRICS_FILE).is_file()]
    common = common_overrides(jobs)
    return [
        Run(
            " ".join(o for o in j["overrides"] if o not in common) or j["dir"],
            sweep / j["dir"] / METRICS_FILE,
        )
        for j in jobs
    ]


def find_runs(paths: Sequence[Path]) -> list[Run]:
    """Each path is a run directory, a metrics.jsonl, or a sweep directory (its jobs)."""
    runs: list[Run] = []
    for p in paths:
        if p.is_file():
            runs.append(Run(p.parent.name or str(p), p))
        elif (p / METRICS_FILE).is_file():
            runs.append(Run(p.name, p / METRICS_FILE))
        elif p.is_dir() and (jobs := _sweep_jobs(p)):
            for job in jobs:  # several paths: say which sweep a job belongs to
                job.label = f"{p.name}: {job.label}" if len(paths) > 1 else job.label
            runs.extend(jobs)
        elif p.exists():
            raise PlotError(
                f"{p}: no {METRICS_FILE} in it nor in any subdirectory (is it a run directory, "
                "e.g. outputs/<date>/<time>, or a sweep directory, multirun/<date>/<time>?)"
            )
        else:
            raise PlotError(f"{p}: no such file or directory")
    labels = [r.label for r in runs]
    for r in runs:  # two runs named alike (e.g. the same time on two dates): use the path
        if labels.count(r.label) > 1:
            r.label = str(r.path.parent)
    for r in runs:
        r.rows = read_metrics(r.path)
    return runs


def parse_metric(spec: str) -> tuple[str, str]:
    """'train/loss' -> ('train', 'loss'); a bare key takes the split it is logged under;
    'eval/auc' (the name before evaluation rows were named by their split) -> ('val', 'auc')."""
    split, sep, key = spec.partition("/")
    if sep and split == LEGACY_EVAL:
        return "val", key
    if sep and split in SPLITS:
        return split, key
    return _SPLIT_OF.get(spec, "val" if _TOPK.match(spec) else "train"), spec


def expand(metrics: Sequence[str], runs: list[Run]) -> list[str]:
    """`metrics` with each '<split>/hr@K' (any key ending in '@K') replaced by that key at
    every K the runs logged, in increasing K."""
    out: list[str] = []
    for m in metrics:
        if not m.endswith("@K"):
            out.append(m)
            continue
        split, key = parse_metric(m[:-2])
        ks = {
            int(k.rpartition("@")[2])
            for run in runs
            for r in run.rows
            if row_split(r) == split
            for k in r
            if k.startswith(key + "@") and k.rpartition("@")[2].isdigit()
        }
        out += [f"{split}/{key}@{k}" for k in sorted(ks)]
    return out


def series(rows: list[dict[str, Any]], split: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` in the `split` rows that have a number for it."""
    steps, values = [], []
    for r in rows:
        v = r.get(key)
        if row_split(r) == split and isinstance(v, (int, float)) and "step" in r:
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (1: unchanged)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def default_out(paths: Sequence[Path]) -> Path:
    """Where the PNG goes without -o: into the one run's directory (the one a metrics.jsonl
    is in) or the one sweep's directory, as PNG_NAME. Several paths have no directory of
    their own: PlotError."""
    if len(paths) > 1:
        raise PlotError(
            f"{len(paths)} runs or sweeps given: name the PNG to write with -o (one run or sweep "
            f"is plotted into its own directory, as {PNG_NAME})"
        )
    p = paths[0]
    return (p.parent if p.is_file() else p) / PNG_NAME


def _write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """write() into a temporary file beside `path`, then rename it over `path`: a failed
    write leaves an earlier file there as it was."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def plot(
    runs: list[Run],
    metrics: Sequence[str],
    out: Path,
    smooth_window: int = 1,
    title: str | None = None,
) -> list[str]:
    """Draw one panel per metric that some run logged; write `out` (PNG) and its CSV beside
    it. Returns the metrics drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotError(
            "hybridrec-plot needs matplotlib: pip install 'hybridrec[plot]' (or matplotlib)"
        ) from e
    metrics = expand(metrics, runs)
    data: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for m in metrics:
        per_run = {r.label: series(r.rows, *parse_metric(m)) for r in runs}
        data[m] = {label: xy for label, xy in per_run.items() if xy[0]}
    drawn = [m for m in metrics if data[m]]
    if not drawn:
        keys = sorted({f"{row_split(r)}/{k}" for run in runs for r in run.rows for k in r})
        raise PlotError(
            f"none of the metrics {', '.join(metrics)} is in "
            f"{', '.join(str(r.path) for r in runs)}; logged: {', '.join(keys) or 'nothing'}"
        )
    cols = 1 if len(drawn) == 1 else 2
    rows_n = (len(drawn) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.5 * cols, 3.8 * rows_n), squeeze=False)
    for ax, m in zip(axes.flat, drawn, strict=False):
        split, _ = parse_metric(m)
        for label, (steps, values) in data[m].items():
            y = smooth(values, smooth_window) if split == "train" else values
            # a one-point line draws nothing: mark points of eval rows and of any single point
            marker = "o" if split != "train" or len(steps) == 1 else None
            ax.plot(steps, y, label=label, marker=marker, markersize=3)
        smoothed = f" (mean of {smooth_window})" if split == "train" and smooth_window > 1 else ""
        ax.set_title(m + smoothed)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(drawn) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        _write_atomically(out, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    finally:
        plt.close(fig)

    def write_csv(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["run", "metric", "step", "value"])
            for m in drawn:
                for label, (steps, values) in data[m].items():
                    w.writerows([label, m, s, v] for s, v in zip(steps, values, strict=True))

    _write_atomically(out.with_suffix(".csv"), write_csv)
    return drawn


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hybridrec-plot",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", type=Path, help="run dirs, sweep dirs or metrics.jsonl")
    p.add_argument(
        "-o",
        "--out",
        type=Path,
        default=None,
        help=f"PNG to write (default: {PNG_NAME} in the run's or sweep's directory; several "
        "paths need it)",
    )
    p.add_argument(
        "--metrics",
        default=None,
        help=f"comma-separated, split/key or key (default: those of {','.join(DEFAULT_METRICS)} "
        "that were logged); any logged key works, e.g. time_ms/lookup, cache/hit_rate, lr/sparse",
    )
    p.add_argument(
        "--smooth", type=int, default=1, help="moving average over N train points (default 1)"
    )
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.smooth < 1:
        p.error(f"--smooth must be >= 1, got {args.smooth}")
    given = args.metrics is not None
    metrics = [m.strip() for m in (args.metrics or ",".join(DEFAULT_METRICS)).split(",")]
    metrics = [m for m in metrics if m]
    if not metrics:
        p.error("--metrics is empty")
    try:
        out = args.out if args.out is not None else default_out(args.paths)
        runs = find_runs(args.paths)
        drawn = plot(runs, metrics, out, args.smooth, args.title)
    except (PlotError, OSError) as e:
        print(f"hybridrec-plot: {e}", file=sys.stderr)
        return 2
    # a default metric the runs' task does not log (AUC of a regression run) is no news
    skipped = [m for m in expand(metrics, runs) if m not in drawn] if given else []
    print(
        f"wrote {out} and {out.with_suffix('.csv')}: {len(runs)} run(s), "
        f"{', '.join(drawn)}" + (f" (not logged: {', '.join(skipped)})" if skipped else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
