"""The plan: which input files, in which order, how many train rows each; the run's fingerprint."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridrec.data.criteo import count_lines
from hybridrec.data.manifest import FORMAT, VERSION
from hybridrec.data.preprocess.options import PreprocessOptions, UsageError


@dataclass(frozen=True)
class FileTask:
    """One input file's work, as handed to a worker process (so: picklable)."""

    path: str
    work: str  # this file's directory under .work/
    train_limit: int  # -1 = all rows are train
    options: PreprocessOptions
    fingerprint: str
    vocab_dir: str | None = None


def _natural_key(name: str) -> list:
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def list_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """Files given directly, plus the visible files of given directories, in natural order."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(
                (f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")),
                key=lambda f: _natural_key(f.name),
            )
            if not found:
                raise UsageError(f"input directory {p} holds no files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise UsageError(f"input {p} does not exist")
    if not files:
        raise UsageError("no input files given")
    return sorted(files, key=lambda f: _natural_key(f.name)) if len(inputs) > 1 else files


def fingerprint(files: Sequence[Path], options: PreprocessOptions) -> str:
    """A hash of the format, the output options and every input's name, size and mtime."""
    ident = {
        "format": [FORMAT, VERSION],
        "options": options.output_options(),
        "inputs": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def _train_limits(files: Sequence[Path], options: PreprocessOptions) -> list[int]:
    """Per file, how many of its first good rows are train (-1 = all of them)."""
    if options.split == "days":
        if options.holdout_days >= len(files):
            raise UsageError(
                f"split=days holds out the last {options.holdout_days} file(s) but only "
                f"{len(files)} input file(s) were given; use split=rows (train_fraction) or "
                "fewer holdout_days (hybridrec-preprocess: --split rows --train-fraction F, or "
                "--holdout-days N)"
            )
        n_train = len(files) - options.holdout_days
        return [-1 if i < n_train else 0 for i in range(len(files))]
    return [math.floor(options.train_fraction * count_lines(f)) for f in files]
