"""hybridrec's sequential preset against SASRec as the paper trains it, on one split in one run
(issue 39's quality goals): Amazon Games (or any `user item` file), leave-one-out.

    python -m benchmarks.sasrec_games --data ../shared/data/amazon_games.txt \
        --work /tmp/sasrec_games --out benchmarks/results/sasrec_games.md

Two sides, started together, one torch thread per process:
- **hybridrec**: `hybridrec-train experiment=sasrec_games` (conf/experiment/sasrec_games.yaml)
  on `--nproc` ranks, 2 by default: what examples/sequential/run.sh runs, the item table
  row-wise over the ranks (any world size gives the same up to float32 round-off), plus
  `--set` overrides; its test row is the last row of its metrics.jsonl, its wall time the
  example's (under the baseline's load: an upper bound of the example's alone).
- **the paper's SASRec** in plain PyTorch (benchmarks/sasrec_baseline.py with its defaults:
  BCE with one negative per position, max_len 50, width 50, 2 blocks, 1 head, dropout 0.5,
  Adam lr 0.001 (beta2 0.98), batch 128, the epoch chosen on val sampled NDCG@10 among
  every 5th up to 200, patience 6 evaluations).

Both are scored by the same code (hybridrec.train.next_item_eval): the full catalogue with the
user's input items excluded, and the published sampled protocol (the held-out item among 100
items the user never interacted with, seed 0). The report gives both sides' val and test
rows, the test full-catalogue HR@10 ratio, and the issue's checks: the baseline counts only
if its test sampled HR@10 is within 0.02 of the paper's Table III (0.7410).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks import sasrec_baseline
from benchmarks.common import command_line, git_state, hardware, load_average, markdown_table

PAPER = {"sampled_hr@10": 0.7410, "sampled_ndcg@10": 0.5360}  # SASRec, Table III, Games
GOALS = {"sampled_hr@10": 0.76, "sampled_ndcg@10": 0.55, "ratio": 1.10}
COLUMNS = ("sampled_hr@10", "sampled_ndcg@10", "hr@10", "ndcg@10", "hr@50")


def start_hybridrec(args: argparse.Namespace, run: Path) -> subprocess.Popen:
    """The preset's run in the background, its log beside it."""
    cmd = [
        sys.executable, "-m", "hybridrec.main", "experiment=sasrec_games",
        f"data.path={args.data}", f"launcher.nproc_per_node={args.nproc}",
        f"hydra.run.dir={run}", *args.set,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(run.parent / "hybridrec.log", "w") as log:  # the child keeps its own copy
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def hybridrec_rows(run: Path) -> tuple[dict, dict, str]:
    """(last val row, test row, the run's length: its config's epochs, else its steps) of the
    preset's run directory."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in rows if "sampled_hr@10" in r]
    if not evals or evals[-1].get("split") != "test" or len(evals) < 2:
        raise SystemExit(f"{run}/metrics.jsonl has no val and test rows: see hybridrec.log")
    epochs = OmegaConf.load(run / ".hydra" / "config.yaml").train.epochs
    length = f"{epochs:g}" if epochs is not None else f"{evals[-1]['step']} steps"
    return evals[-2], evals[-1], length


def figures(row: dict) -> list[str]:
    return [f"{row[k]:.4f}" for k in COLUMNS]


def report(args: argparse.Namespace, base: dict, ours: tuple, seconds: dict) -> str:
    val, test, length = ours
    ratio = test["hr@10"] / base["test"]["hr@10"]
    counts = abs(base["test"]["sampled_hr@10"] - PAPER["sampled_hr@10"]) <= 0.02
    header = ["system", "split", *COLUMNS, "epochs", "wall min"]
    rows = [
        ["SASRec (paper's training), plain PyTorch", "val", *figures(base["val"]),
         base["best_epoch"], f"{seconds['baseline'] / 60:.1f}"],
        ["", "test", *figures(base["test"]), "", ""],
        [f"hybridrec, experiment=sasrec_games, {args.nproc} rank(s)", "val", *figures(val),
         length, f"{seconds['hybridrec'] / 60:.1f}"],
        ["", "test", *figures(test), "", ""],
        ["SASRec paper, Table III", "test", *(f"{PAPER[k]:.4f}" for k in COLUMNS[:2]),
         "-", "-", "-", "", ""],
    ]  # fmt: skip
    checks = [
        f"- Baseline counts (test sampled HR@10 within 0.02 of the paper's 0.7410): "
        f"{'yes' if counts else 'NO'} ({base['test']['sampled_hr@10']:.4f})",
        f"- Test sampled HR@10 >= {GOALS['sampled_hr@10']}: "
        f"{'met' if test['sampled_hr@10'] >= GOALS['sampled_hr@10'] else 'NOT met'} "
        f"({test['sampled_hr@10']:.4f}); NDCG@10 >= {GOALS['sampled_ndcg@10']}: "
        f"{'met' if test['sampled_ndcg@10'] >= GOALS['sampled_ndcg@10'] else 'NOT met'} "
        f"({test['sampled_ndcg@10']:.4f})",
        f"- Test full-catalogue HR@10, hybridrec / baseline: **{ratio:.2f}x** "
        f"({test['hr@10']:.4f} / {base['test']['hr@10']:.4f}; goal >= {GOALS['ratio']}x: "
        f"{'met' if ratio >= GOALS['ratio'] else 'NOT met'})",
    ]
    return "\n".join([
        "# Amazon Games: hybridrec's sequential preset vs SASRec as the paper trains it",
        "",
        f"Command: `{command_line()}`",
        "",
        f"- Hardware: {hardware()}; commit {git_state()}; load average after: {load_average()}",
        f"- Data: {args.data.name}, leave-one-out (per user the last event test, the one before "
        "val); scored by hybridrec.train.next_item_eval (module docstring of "
        "benchmarks/sasrec_games.py): full catalogue with the input items excluded, and 100 "
        "sampled items the user never interacted with (seed 0)",
        f"- hybridrec overrides: `{' '.join(args.set) or '(none)'}`; run dir {args.work}/hybridrec",
        f"- Baseline: benchmarks/sasrec_baseline.py, arguments "
        f"`{' '.join(args.baseline) or '(its defaults)'}`, stopped by {base['stopped_by']} after "
        f"{base['epochs_run']} epochs, best epoch {base['best_epoch']} on val sampled NDCG@10",
        "- Both sides ran at the same time, one torch thread per process: the wall times are "
        "of a shared machine",
        "",
        markdown_table(header, rows),
        "",
        *checks,
        "",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--data", type=Path, default=sasrec_baseline.DEFAULT_DATA)
    p.add_argument("--work", type=Path, required=True, help="runs and logs go here")
    p.add_argument("--out", type=Path, default=None, help="the markdown report")
    p.add_argument("--nproc", type=int, default=2, help="hybridrec's ranks (2)")
    p.add_argument("--set", nargs="*", default=[], help="hybridrec overrides (key=value ...)")
    p.add_argument(
        "--baseline", nargs=argparse.REMAINDER, default=[], help="sasrec_baseline's arguments"
    )
    args = p.parse_args(argv)
    args.data = args.data.resolve()
    if not args.data.is_file():
        p.error(f"no `user item` file at {args.data}")
    args.work.mkdir(parents=True, exist_ok=True)
    run = args.work / "hybridrec"
    t0 = time.perf_counter()
    child = start_hybridrec(args, run)
    ended: list[float] = []  # the child's end, seen by a thread while the baseline trains
    watcher = threading.Thread(target=lambda: (child.wait(), ended.append(time.perf_counter())))
    watcher.start()
    seconds = {}
    base_json = args.work / "baseline.json"
    try:
        code = sasrec_baseline.main(
            ["--data", str(args.data), "--out", str(base_json), *args.baseline]
        )
        seconds["baseline"] = time.perf_counter() - t0
        if code:
            return code
        watcher.join()
        if child.returncode:
            raise SystemExit(f"hybridrec failed: see {args.work}/hybridrec.log")
    finally:
        if child.poll() is None:
            child.kill()
    seconds["hybridrec"] = ended[0] - t0
    text = report(args, json.loads(base_json.read_text()), hybridrec_rows(run), seconds)
    print(text)
    if args.out:  # atomically: a failed write leaves the last report whole
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
