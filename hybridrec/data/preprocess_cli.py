"""`hybridrec-preprocess`: raw Criteo day files -> a binary dataset directory.

    hybridrec-preprocess --input /data/criteo/raw --output /data/criteo/bin
    hybridrec-preprocess --input day_0.gz day_1.gz day_2.gz --output bin --encoding vocab \\
        --min-count 3
    hybridrec-preprocess --input sample.tsv --output bin --train-fraction 0.9
    hybridrec-preprocess --spec spec.yaml --input events/ --output bin   (your own table)
    hybridrec-preprocess --spec spec.yaml --input day_2/ --output day_2_bin \
        --stats-from day_1_bin                 (standardize as yesterday's dataset did)

With --spec, the inputs are Parquet or CSV/TSV tables described by the dataset spec
(docs/data-spec.md; hybridrec.data.tabular): one line per feature is printed, and the Criteo
options (--encoding, --hash-cap, --min-count, --split, ...) do not apply.

With one input file the split defaults to rows (each file's first --train-fraction is train,
the rest val + test, a note says so); with several, to days (--holdout-days last files).

What it does, the output format, the memory bound and how reruns resume: docs/preprocessing.md
("Preprocessing raw Criteo files"); the contract is hybridrec.data.preprocess's docstring.
Exit status 0 on success (a summary on stdout); otherwise one line
`hybridrec-preprocess: error: <message>` and 2 when the command is wrong (an option, the
spec, an input that does not exist, an output holding another dataset without --overwrite:
nothing was read), 1 for an error while running (a bad row naming its file and line, a full
disk naming the directory), 130 on Ctrl-C. A failed or interrupted run leaves --output as it
was (hybridrec.data.preprocess.output).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from hybridrec.data.preprocess import (
    MLPERF_CAP,
    PreprocessOptions,
    UsageError,
    list_inputs,
    preprocess,
)
from hybridrec.data.preprocess.output import DiskFullError

USAGE_EXIT, FAILED_EXIT = 2, 1  # as hybridrec-train (hybridrec.train.exits)

log = logging.getLogger("hybridrec")


def _caps(text: str) -> int | tuple[int, ...]:
    parts = [p for p in text.split(",") if p.strip()]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hash-cap {text!r}: give an int or 26 ints") from None
    return values[0] if len(values) == 1 else tuple(values)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybridrec-preprocess",
        description="Turn raw Criteo TSV day files (plain or gzip) into a hybridrec binary "
        "dataset: blocked .npy arrays plus manifest.json.",
    )
    p.add_argument(
        "--spec", default=None, help="a dataset spec (YAML): preprocess your own Parquet/CSV table"
    )
    p.add_argument("--input", nargs="+", required=True, help="day files and/or directories")
    p.add_argument("--output", required=True, help="dataset directory to create or resume")
    p.add_argument("--encoding", choices=("hash", "vocab"), default="hash")
    p.add_argument(
        "--hash-cap", type=_caps, default=MLPERF_CAP, help="hash: one cap or 26 comma-separated"
    )
    p.add_argument(
        "--min-count", type=int, default=1, help="vocab: rarer train values share one id"
    )
    p.add_argument(
        "--split",
        choices=("days", "rows"),
        default=None,
        help="days: whole files held out; rows: each file's last rows (default: days, or rows "
        "when there is a single input file)",
    )
    p.add_argument(
        "--holdout-days", type=int, default=1, help="days: last N files become val + test"
    )
    p.add_argument("--train-fraction", type=float, default=0.8, help="rows: train part per file")
    p.add_argument("--block-rows", type=int, default=16384, help="rows per block")
    p.add_argument(
        "--no-checksums", dest="checksums", action="store_false", help="skip per-block CRC32"
    )
    p.add_argument("--on-error", choices=("error", "skip"), default="error", help="malformed rows")
    p.add_argument("--chunk-mb", type=int, default=4, help="text per parse block (memory bound)")
    p.add_argument("--workers", type=int, default=None, help="parallel files (default: cores)")
    p.add_argument("--overwrite", action="store_true", help="replace a different dataset")
    p.add_argument("--keep-work", action="store_true", help="keep .work/ (per-file parts)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument(
        "--batch-rows", type=int, default=65536, help="--spec: rows per read batch (memory)"
    )
    p.add_argument(
        "--stats-from",
        default=None,
        metavar="DIR",
        help="--spec: standardize with the statistics of dataset DIR (yesterday's, made with "
        "the same spec) instead of this train split's",
    )
    return p


CRITEO_ONLY = (
    "encoding",
    "hash_cap",
    "min_count",
    "split",
    "holdout_days",
    "train_fraction",
    "on_error",
    "chunk_mb",
    "workers",
    "keep_work",
)


def _table(args: argparse.Namespace) -> int:
    """--spec: a Parquet/CSV table described by a dataset spec."""
    from hybridrec.data.spec import load_spec
    from hybridrec.data.tabular import preprocess_table

    p = parser()
    given = [k for k in CRITEO_ONLY if getattr(args, k) != p.get_default(k)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(f"{flag} applies to raw Criteo files; with --spec the spec sets it")
    try:
        spec = load_spec(args.spec)
    except ValueError as e:
        raise UsageError(str(e)) from None
    report = preprocess_table(
        spec,
        args.input,
        args.output,
        block_rows=args.block_rows,
        checksums=args.checksums,
        overwrite=args.overwrite,
        batch_rows=args.batch_rows,
        stats_from=args.stats_from,
    )
    m = report.manifest
    if report.up_to_date:
        print(f"{args.output}: up to date ({m.num_rows:,} rows, fingerprint {m.fingerprint})")
        return 0
    for line in report.lines:
        print(line)
    splits = ", ".join(f"{k} {v[1] - v[0]:,}" for k, v in m.splits.items())
    dropped = f", {m.skipped_rows:,} rows in no split dropped" if m.skipped_rows else ""
    print(
        f"wrote {os.path.abspath(args.output)}: {m.num_rows:,} rows ({splits}{dropped}) from "
        f"{len(m.sources)} file(s) in {report.seconds:.1f}s"
    )
    return 0


def _default_split(inputs: list[str], train_fraction: float) -> str:
    """days, or rows for a single input file (a day split needs a file to hold out)."""
    if len(list_inputs(inputs)) > 1:
        return "days"
    log.info(
        "one input file: splitting its rows (the first %g train, the rest val + test); pass "
        "several day files for a day split",
        train_fraction,
    )
    return "rows"


def summarise_counts(values: list[int]) -> str:
    """Runs of equal values as `value x count` (26 capped tables are not 26 numbers)."""
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return ", ".join(f"{v:,}" + (f" x{n}" if n > 1 else "") for v, n in runs)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    term = signal.signal(signal.SIGTERM, _interrupted)  # as Ctrl-C: clean up, say so
    try:
        return _table(args) if args.spec is not None else _criteo(args)
    except UsageError as e:  # the command, spec, inputs or output: nothing was read
        return _error(str(e), USAGE_EXIT)
    except ValueError as e:  # bad input data: one clear line, no traceback
        return _error(str(e), FAILED_EXIT)
    except DiskFullError as e:
        return _error(str(e), FAILED_EXIT)
    except OSError as e:  # an output that cannot be written, an input that cannot be read
        return _error(f"{type(e).__name__}: {e}", FAILED_EXIT)
    except KeyboardInterrupt:
        again = " (the same command resumes)" if args.spec is None else ""
        return _error(f"interrupted; {args.output} was not changed{again}", 130)
    finally:
        signal.signal(signal.SIGTERM, term)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _error(message: str, code: int) -> int:
    print(f"hybridrec-preprocess: error: {message}", file=sys.stderr)
    return code


def _criteo(args: argparse.Namespace) -> int:
    """Raw Criteo day files (no --spec)."""
    if args.stats_from is not None:
        raise UsageError("--stats-from applies to --spec datasets (standardize); Criteo's has none")
    options = PreprocessOptions(
        encoding=args.encoding,
        hash_cap=args.hash_cap,
        min_count=args.min_count,
        split=args.split or _default_split(args.input, args.train_fraction),
        holdout_days=args.holdout_days,
        train_fraction=args.train_fraction,
        block_rows=args.block_rows,
        checksums=args.checksums,
        on_error=args.on_error,
        chunk_bytes=args.chunk_mb << 20,
    )
    report = preprocess(
        args.input,
        args.output,
        options,
        workers=args.workers,
        progress=args.progress and sys.stderr.isatty(),
        overwrite=args.overwrite,
        keep_work=args.keep_work,
    )
    m = report.manifest
    if report.up_to_date:
        print(f"{args.output}: up to date ({m.num_rows:,} rows, fingerprint {m.fingerprint})")
        return 0
    splits = ", ".join(f"{k} {v[1] - v[0]:,}" for k, v in m.splits.items())
    print(
        f"wrote {os.path.abspath(args.output)}: {m.num_rows:,} rows ({splits}) from "
        f"{len(m.sources)} file(s) in {report.seconds:.1f}s"
        + (f", {report.reused_files} file(s) reused" if report.reused_files else "")
    )
    print(f"cardinalities: {summarise_counts(m.cardinalities)}")
    if m.skipped_rows:
        per_file = ", ".join(f"{s.file}: {s.skipped_rows}" for s in m.sources if s.skipped_rows)
        print(f"skipped {m.skipped_rows:,} malformed row(s) ({per_file}); first:")
        for e in report.skipped_examples[:5]:
            print(f"  {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
