"""Assembly: the committed parts -> the dataset's arrays, id-count files and manifest parts.

Each array is copied part by part (train rows of every file, then held-out rows) into a
`.npy.tmp` with a v1.0 header, the last block zero-padded, CRC32 per block on the way, and
renamed into place. `_schema` and `_encoding` are the manifest's description of the output.
"""

from __future__ import annotations

import math
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from hybridrec.data.criteo import FIELD_NAMES, NUM_CAT, NUM_DENSE
from hybridrec.data.encode import MISSING_ID, RARE_ID
from hybridrec.data.manifest import ArraySpec, TableStats
from hybridrec.data.preprocess.options import ARRAYS, PreprocessOptions
from hybridrec.data.preprocess.vocab import _top


class BlockCrc:
    """CRC32 of consecutive `block_bytes`-sized blocks of a byte stream."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes, self.crcs, self._crc, self._filled = block_bytes, [], 0, 0

    def update(self, buf: bytes | memoryview) -> None:
        view = memoryview(buf).cast("B")
        while len(view):
            take = min(len(view), self.block_bytes - self._filled)
            self._crc = zlib.crc32(view[:take], self._crc)
            self._filled += take
            view = view[take:]
            if self._filled == self.block_bytes:
                self.crcs.append(self._crc)
                self._crc, self._filled = 0, 0


def write_npy_header(f: Any, dtype: str, shape: tuple[int, ...]) -> None:
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False}
    header["shape"] = shape
    np.lib.format.write_array_header_1_0(f, header)  # DALI reads v1.0 only


def _assemble_array(
    path: Path,
    name: str,
    ranges: list[tuple[Path, int, int]],
    num_rows: int,
    block_rows: int,
    checksums: bool,
) -> ArraySpec:
    dtype, row_shape = ARRAYS[name]
    row_bytes = np.dtype(dtype).itemsize * math.prod(row_shape)
    num_blocks = -(-num_rows // block_rows)
    crc = BlockCrc(block_rows * row_bytes) if checksums else None
    tmp = path.with_suffix(".npy.tmp")
    step = max(row_bytes, (8 << 20) // row_bytes * row_bytes)
    with open(tmp, "wb") as out:
        write_npy_header(out, dtype, (num_blocks, block_rows, *row_shape))
        for part, start, end in ranges:
            with open(part / f"{name}.bin", "rb") as src:
                src.seek(start * row_bytes)
                left = (end - start) * row_bytes
                while left:
                    buf = src.read(min(step, left))
                    if not buf:
                        raise ValueError(f"{part / (name + '.bin')} is shorter than its meta says")
                    out.write(buf)
                    if crc is not None:
                        crc.update(buf)
                    left -= len(buf)
        pad = bytes((num_blocks * block_rows - num_rows) * row_bytes)
        out.write(pad)
        if crc is not None:
            crc.update(pad)
    os.replace(tmp, path)
    return ArraySpec(path.name, dtype, list(row_shape), crc.crcs if crc is not None else None)


def _write_counts(work: Path, output: Path, sizes: list[int]) -> list[TableStats]:
    """Copy each table's train id counts to `counts/cat_<t>.npz`; the manifest's table stats."""
    (output / "counts").mkdir(exist_ok=True)
    tables = []
    for t in range(NUM_CAT):
        src = work / "vocab" / f"cat_{t}.counts.npz"
        dst = output / "counts" / f"cat_{t}.npz"
        shutil.copyfile(src, dst)
        with np.load(dst, allow_pickle=False) as z:
            ids, counts = z["ids"], z["counts"]
        tables.append(
            TableStats(
                f"cat_{t}",
                FIELD_NAMES[1 + NUM_DENSE + t],
                int(sizes[t]),
                int(ids.size),
                f"counts/cat_{t}.npz",
                _top(ids, counts),
            )
        )
    return tables


def _schema() -> dict[str, Any]:
    return {
        "raw": "tab-separated: label, I1..I13 (integers), C1..C26 (hex); empty fields allowed",
        "labels": {"fields": ["label"], "dtype": "uint8", "shape": ["N"]},
        "dense": {"fields": FIELD_NAMES[1 : 1 + NUM_DENSE], "dtype": "float32", "shape": ["N", 13]},
        "categorical": {
            "fields": FIELD_NAMES[1 + NUM_DENSE :],
            "tables": [f"cat_{t}" for t in range(NUM_CAT)],
            "dtype": "int32",
            "shape": ["N", 26],
        },
        "layout": "each .npy is [num_blocks, block_rows, ...]; rows >= num_rows are zero padding",
    }


def _encoding(options: PreprocessOptions) -> dict[str, Any]:
    if options.encoding == "hash":
        return {
            "kind": "hash",
            "rule": "id = value mod cap (empty field = value 0, as in MLPerf)",
            "caps": options.caps(),
        }
    return {
        "kind": "vocab",
        "rule": "values seen >= min_count times in train get ids 2.. by decreasing train "
        "frequency (ties by value); rarer or unseen values share the rare id, empty fields "
        "the missing id",
        "min_count": options.min_count,
        "missing_id": MISSING_ID,
        "rare_id": RARE_ID,
        "counted_on": "train",
    }
