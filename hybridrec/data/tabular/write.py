"""Writing a table dataset: per-split parts -> the blocked arrays, counts files and manifest.

Pass 2 appends each batch's kept rows to one raw part per (split, array) under `.work/`;
`assemble` then writes each array as `[num_blocks, block_rows, *row_shape]` .npy (v1.0
header, rows in split order train | val | test, the last block zero-padded, CRC32 per block)
through a .tmp and a rename, exactly the layout hybridrec.data.dataset reads for Criteo:

    labels       [N]      float32 (0/1 or the regression target)
    dense        [N, F]   float32 (transformed; F = 0 for a spec without dense columns: the
                          file is its header alone)
    categorical  [N, H]   int32, or int64 when a table has 2^31 rows or more or is dynamic
                          (raw ids, hybridrec.data.tabular.encode); table-major
                          columns, each table's `hotness` of them, lists padded with -1
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hybridrec.data.manifest import ArraySpec, TableStats
from hybridrec.data.preprocess.assemble import BlockCrc, write_npy_header
from hybridrec.data.preprocess.vocab import _top
from hybridrec.data.tabular.scan import SPLIT_CODES

ARRAY_NAMES = ("labels", "dense", "categorical")


class SplitParts:
    """Raw row parts, one file per (split, array), appended batch by batch."""

    def __init__(self, work: Path, row_shapes: dict[str, tuple[int, ...]], dtypes: dict) -> None:
        self.work, self.row_shapes, self.dtypes = work, row_shapes, dtypes
        self.rows = dict.fromkeys(SPLIT_CODES, 0)
        self._files = {
            (s, a): open(work / f"{s}.{a}.bin", "wb") for s in SPLIT_CODES for a in ARRAY_NAMES
        }

    def add(self, codes: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        for split, code in SPLIT_CODES.items():
            mask = codes == code
            if not mask.any():
                continue
            self.rows[split] += int(mask.sum())
            for a in ARRAY_NAMES:
                x = np.ascontiguousarray(arrays[a][mask], dtype=self.dtypes[a])
                if x.size:  # a spec without dense columns: dense rows are 0 bytes
                    self._files[(split, a)].write(memoryview(x).cast("B"))

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def assemble(self, output: Path, block_rows: int, checksums: bool) -> dict[str, ArraySpec]:
        """The three arrays of the dataset (see the module docstring)."""
        num_rows = sum(self.rows.values())
        num_blocks = -(-num_rows // block_rows)
        specs = {}
        for a in ARRAY_NAMES:
            dtype, shape = np.dtype(self.dtypes[a]), self.row_shapes[a]
            row_bytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            crc = BlockCrc(block_rows * row_bytes) if checksums else None
            path = output / f"{a}.npy"
            tmp = path.with_suffix(".npy.tmp")
            with open(tmp, "wb") as out:
                write_npy_header(out, dtype.str, (num_blocks, block_rows, *shape))
                for split in SPLIT_CODES:
                    with open(self.work / f"{split}.{a}.bin", "rb") as src:
                        while buf := src.read(8 << 20):
                            out.write(buf)
                            if crc is not None:
                                crc.update(buf)
                pad = bytes((num_blocks * block_rows - num_rows) * row_bytes)
                out.write(pad)
                if crc is not None:
                    crc.update(pad)
            os.replace(tmp, path)
            crcs = crc.crcs if crc else None
            if crcs is not None and row_bytes == 0:  # 0-byte blocks: each one's CRC32 is 0
                crcs = [0] * num_blocks
            specs[a] = ArraySpec(path.name, dtype.name, list(shape), crcs)
        return specs

    def splits(self) -> dict[str, list[int]]:
        out, start = {}, 0
        for s in SPLIT_CODES:
            out[s] = [start, start + self.rows[s]]
            start += self.rows[s]
        return out


def write_counts(output: Path, features: list) -> list[TableStats]:
    """Each feature's train frequency of every id it used, and the manifest's stats, one per
    feature in feature order: counts/<table>.npz for a table of one feature, and
    counts/<table>/<feature>.npz for each feature of a shared table (their sum is the table's)."""
    (output / "counts").mkdir(exist_ok=True)
    tables = []
    for f in features:
        ids, counts = f.train_counts()  # dynamic: raw ids (not rows), as the data holds them
        rel = f"counts/{f.table.name}.npz"
        if f.shared_with:
            (output / "counts" / f.table.name).mkdir(exist_ok=True)
            rel = f"counts/{f.table.name}/{f.spec.name}.npz"
        np.savez(output / rel, ids=ids, counts=counts)
        tables.append(
            TableStats(
                f.table.name, f.spec.column, f.num_embeddings, int(ids.size), rel, _top(ids, counts)
            )
        )
    return tables


class Moments:
    """Mean and standard deviation of a stream of float64 chunks (Chan's parallel update)."""

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, x: np.ndarray) -> None:
        if not x.size:
            return
        n, mean = x.size, float(x.mean())
        m2 = float(((x - mean) ** 2).sum())
        delta, total = mean - self.mean, self.n + n
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total

    @property
    def std(self) -> float:
        return (self.m2 / self.n) ** 0.5 if self.n else 0.0
