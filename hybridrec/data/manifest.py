"""The manifest: one JSON file that says what a preprocessed dataset directory holds.

`manifest.json` is written last, atomically, by `hybridrec-preprocess`; its presence marks the
directory complete. It records

- the schema: which raw fields went to which array, dtypes and row shapes;
- the arrays: file names, and with `--checksums` one CRC32 per block of `block_rows` rows;
- row counts: in total, per split (train/val/test are contiguous row ranges, in that order),
  per source file (rows kept, rows in train, malformed rows skipped);
- per table (per feature, in feature order: features sharing a table repeat it): its
  cardinality (`num_embeddings`, the rows a model's table needs), how many distinct ids the
  train split uses, its hottest ids, and the file with every id's train frequency
  (`counts/cat_<t>.npz`: `ids`, `counts`, for hot-row caches);
- the encoding and transforms, the options that produced it and their fingerprint;
- for a table made from a dataset spec (hybridrec.data.spec): the normalised `spec` and per
  feature (`features`, in table order) its table (`shared_with`: the table's other features,
  when shared), width, hotness, jagged and pooling flags and statistics; Criteo datasets
  have neither (`spec` None), and their tables are one-hot.

Arrays: labels [N] (uint8 for Criteo, float32 for a table), dense [N, F] float32,
categorical [N, H] int32 or int64 (H = the sum of the tables' hotness; padding -1).

Manifest.load(path).to_dict() == json.load(path): the round trip is exact (tested).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "hybridrec-criteo-binary"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val", "test")


@dataclass
class ArraySpec:
    """One array file: `[num_blocks, block_rows, *row_shape]` of `dtype` in .npy format."""

    file: str
    dtype: str
    row_shape: list[int]
    block_crc32: list[int] | None = None  # one per block, over the block's bytes


@dataclass
class TableStats:
    name: str  # the model's table name, cat_<t> (a spec dataset: the table the feature uses)
    field: str  # the raw column, C<t+1>
    num_embeddings: int  # ids are in [0, num_embeddings)
    distinct_train_ids: int
    counts_file: str  # npz with `ids` (ascending) and `counts`: train frequency of each id
    top_ids: list[list[int]] = field(default_factory=list)  # [[id, count], ...] hottest first


@dataclass
class SourceFile:
    file: str
    bytes: int
    rows: int  # good rows kept
    train_rows: int  # of which in the train split (the file's first train_rows rows)
    skipped_rows: int = 0  # malformed rows dropped (on_error=skip)


@dataclass
class Manifest:
    num_rows: int
    block_rows: int
    splits: dict[str, list[int]]  # name -> [start, end) rows
    arrays: dict[str, ArraySpec]  # labels, dense, categorical
    tables: list[TableStats]
    schema: dict[str, Any]
    encoding: dict[str, Any]
    transforms: dict[str, str]
    sources: list[SourceFile]
    options: dict[str, Any]
    fingerprint: str
    skipped_rows: int = 0
    created: str = ""
    format: str = FORMAT
    version: int = VERSION
    spec: dict[str, Any] | None = None  # the dataset spec a table was made with
    features: list[dict[str, Any]] = field(default_factory=list)  # per feature, spec datasets

    @property
    def hotness(self) -> list[int]:
        """Id columns per table in `categorical` (Criteo: one each)."""
        if not self.features:
            return [1] * len(self.tables)
        return [int(f["hotness"]) for f in self.features]

    @property
    def num_blocks(self) -> int:
        return -(-self.num_rows // self.block_rows)

    @property
    def cardinalities(self) -> list[int]:
        return [t.num_embeddings for t in self.tables]

    def split_range(self, split: str) -> tuple[int, int]:
        if split not in self.splits:
            raise ValueError(f"split {split!r} is not one of: {', '.join(self.splits)}")
        start, end = self.splits[split]
        return int(start), int(end)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["spec"] is None and not d["features"]:  # Criteo: the keys it has always had
            del d["spec"], d["features"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "manifest") -> Manifest:
        if d.get("format") != FORMAT:
            raise ValueError(f"{where}: format {d.get('format')!r} is not {FORMAT!r}")
        if d.get("version") != VERSION:
            raise ValueError(
                f"{where}: format version {d.get('version')!r}, this hybridrec reads {VERSION}; "
                "re-run hybridrec-preprocess"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in d
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        )
        if unknown or missing:
            raise ValueError(f"{where}: unknown keys {unknown}, missing keys {missing}")
        d = dict(d)
        d["arrays"] = {k: ArraySpec(**v) for k, v in d["arrays"].items()}
        d["tables"] = [TableStats(**t) for t in d["tables"]]
        d["sources"] = [SourceFile(**s) for s in d["sources"]]
        return cls(**d)

    def save(self, directory: str | Path) -> Path:
        """Write `<directory>/manifest.json` atomically (temp file + rename)."""
        path = Path(directory) / MANIFEST
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise ValueError(
                f"{path} not found: {directory} is not a preprocessed dataset (or preprocessing "
                "did not finish); create one with hybridrec-preprocess"
            )
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path} is not valid JSON ({e}); re-run hybridrec-preprocess"
            ) from None
        return cls.from_dict(d, str(path))
