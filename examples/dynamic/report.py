"""examples/dynamic/run.sh's result: OUT_DIR/result.json from the runs' metrics.jsonl.

    python examples/dynamic/report.py OUT_DIR

auc_dynamic, auc_hashing, auc_unbounded: each run's test AUC (the last eval row: the day after
the training days); max_rel_loss_diff_1_vs_2_ranks: the largest |l1 - l2| / |l1| over the
train losses both dynamic runs logged (every train.log_every steps), with the step it
happened at; mode: "exact" when both dynamic runs trained with train.exact=true (EXACT=1, then
exact_shards too; the goal is a gap of 0), else "default" (their run directories' composed
.hydra/config.yaml); the goals and whether each is met.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise SystemExit(f"{path} is missing: did its training run finish? (see its log)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_auc(run: Path) -> float:
    evals = [r for r in rows(run / "metrics.jsonl") if r["split"] != "train"]
    if not evals:
        raise SystemExit(f"{run}/metrics.jsonl has no eval row")
    return float(evals[-1]["auc"])


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run / "metrics.jsonl") if r["split"] == "train"}


def exact_shards(run: Path) -> int | None:
    """train.exact_shards when the run trained in exact mode, else None (its composed config)."""
    path = run / ".hydra" / "config.yaml"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: was {run} written by hybridrec.main?")
    train = yaml.safe_load(path.read_text())["train"]
    return int(train["exact_shards"]) if train["exact"] else None


def main(out: Path) -> dict:
    auc = {k: test_auc(out / f"run_{k}") for k in ("dynamic", "hashing", "unbounded")}
    one, two = losses(out / "run_dynamic"), losses(out / "run_dynamic_np2")
    steps = sorted(set(one) & set(two))
    if not steps or len(steps) != len(one):
        raise SystemExit(f"the 1- and 2-rank runs logged different steps: {sorted(one)[:5]} ...")
    diffs = {s: abs(one[s] - two[s]) / abs(one[s]) for s in steps}
    worst = max(diffs, key=diffs.get)
    shards = exact_shards(out / "run_dynamic")
    if exact_shards(out / "run_dynamic_np2") != shards:
        raise SystemExit(
            f"{out}/run_dynamic and run_dynamic_np2 trained in different modes (train.exact, "
            "train.exact_shards): rerun both with the same EXACT"
        )
    stream = json.loads((out / "stream.json").read_text())
    result = {
        "auc_dynamic": auc["dynamic"],
        "auc_hashing": auc["hashing"],
        "auc_unbounded": auc["unbounded"],
        "max_rel_loss_diff_1_vs_2_ranks": diffs[worst],
        "max_rel_loss_diff_step": worst,
        "steps_compared": len(steps),
        "mode": "default" if shards is None else "exact",
        "exact_shards": shards,
        "bayes_auc_test_day": stream["bayes_auc_last_day"],
        "goals": {
            "dynamic_beats_hashing": auc["dynamic"] > auc["hashing"],
            "dynamic_within_0.005_of_unbounded": auc["unbounded"] - auc["dynamic"] <= 0.005,
            "rel_loss_diff_le_1e-5": diffs[worst] <= 1e-5,
        },
    }
    if shards is not None:  # exact mode: the 2-rank run computes the 1-rank run's bits
        result["goals"]["rel_loss_diff_is_0"] = diffs[worst] == 0
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python examples/dynamic/report.py OUT_DIR")
    print(json.dumps(main(Path(sys.argv[1])), indent=1))
