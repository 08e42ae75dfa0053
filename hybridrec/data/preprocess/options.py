"""What a preprocessing run is asked for (PreprocessOptions), what it reports, its constants."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hybridrec.data.criteo import NUM_CAT, NUM_DENSE
from hybridrec.data.manifest import Manifest

MLPERF_CAP = 40_000_000
DENSE_COUNTER_MAX = 1 << 22  # hash tables up to this many rows are counted densely
TOP_IDS = 10
# name -> (dtype, per-row shape): the three arrays of a dataset
ARRAYS: dict[str, tuple[str, tuple[int, ...]]] = {
    "labels": ("uint8", ()),
    "dense": ("float32", (NUM_DENSE,)),
    "categorical": ("int32", (NUM_CAT,)),
}


class UsageError(ValueError):
    """The command is wrong (its options, spec, inputs or output), found before any data
    was read: `hybridrec-preprocess` exits 2 for it, 1 for an error while running."""


class PreprocessCancelled(RuntimeError):
    """Another worker failed; this one stopped early."""


@dataclass(frozen=True)
class PreprocessOptions:
    """Everything that decides the output (plus chunk_bytes, which only bounds memory)."""

    encoding: str = "hash"  # hash | vocab
    hash_cap: int | tuple[int, ...] = MLPERF_CAP  # one cap, or one per table (hash)
    min_count: int = 1  # vocab: values seen fewer times in train share the rare id
    split: str = "days"  # days | rows
    holdout_days: int = 1  # split=days: the last N files become val + test
    train_fraction: float = 0.8  # split=rows: the first part of every file is train
    block_rows: int = 16384  # rows per block: the unit of shuffling and of checksums
    checksums: bool = True  # CRC32 per block in the manifest
    on_error: str = "error"  # error | skip: what a malformed row does
    chunk_bytes: int = 4 << 20  # text per pyarrow block (bounds memory, not the output)

    def __post_init__(self) -> None:
        def bad(key: str, value: object, want: str) -> UsageError:
            return UsageError(f"preprocess option {key}={value!r}: {want}")

        if self.encoding not in ("hash", "vocab"):
            raise bad("encoding", self.encoding, "must be one of: hash, vocab")
        caps = self.caps()
        if len(caps) != NUM_CAT:
            raise bad("hash_cap", self.hash_cap, f"give one int or {NUM_CAT} ints")
        for c in caps:
            if not 1 <= c < 2**31:
                raise bad("hash_cap", self.hash_cap, "every cap must be in [1, 2^31)")
        if self.min_count < 1:
            raise bad("min_count", self.min_count, "must be >= 1")
        if self.split not in ("days", "rows"):
            raise bad("split", self.split, "must be one of: days, rows")
        if self.holdout_days < 0:
            raise bad("holdout_days", self.holdout_days, "must be >= 0")
        if not 0.0 < self.train_fraction <= 1.0:
            raise bad("train_fraction", self.train_fraction, "must be in (0, 1]")
        if self.block_rows < 1:
            raise bad("block_rows", self.block_rows, "must be >= 1")
        if self.on_error not in ("error", "skip"):
            raise bad("on_error", self.on_error, "must be one of: error, skip")
        if self.chunk_bytes < 1 << 16:
            raise bad("chunk_bytes", self.chunk_bytes, "must be >= 65536")

    def caps(self) -> list[int]:
        if isinstance(self.hash_cap, int):
            return [int(self.hash_cap)] * NUM_CAT
        return [int(c) for c in self.hash_cap]

    def output_options(self) -> dict[str, Any]:
        """The options that change the output (what the fingerprint and manifest record)."""
        d = dataclasses.asdict(self)
        d.pop("chunk_bytes")
        d["hash_cap"] = self.caps() if not isinstance(self.hash_cap, int) else self.hash_cap
        return d


@dataclass
class PreprocessReport:
    """What a run did, for the CLI's summary."""

    manifest: Manifest
    up_to_date: bool = False
    reused_files: int = 0
    seconds: float = 0.0
    skipped_examples: list[str] = field(default_factory=list)
