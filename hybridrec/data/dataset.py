"""Open a preprocessed dataset directory: memory-mapped arrays, checked against the manifest.

    ds = open_dataset("criteo_bin/")
    ds.labels       [N]      uint8   (memmap; float32 for a table made from a dataset spec)
    ds.dense        [N, 13]  float32 (memmap; already log(1 + max(x, 0)); [N, F] for a table,
                                      F = 0 when its spec lists no dense column)
    ds.categorical  [N, 26]  int32   (memmap; table t's ids in column t; a table's list
                                      features take `hotness` columns each, padded with -1)
    ds.manifest     the Manifest (splits, cardinalities, encoding, counts files, ...)
    ds.split("val") -> (start, end) rows

On disk every array is `[num_blocks, block_rows, ...]` (.npy, the last block zero-padded) so
that readers can address whole blocks (DALI's numpy reader takes int32 regions, and block
indices stay small however many rows there are); the attributes above are flat views of the
first N rows.

Checks (`verify`):
- "size" (always): each file's .npy header and byte size must match the manifest, so a
  truncated file fails at open, naming the file and the first incomplete block;
- "read": also each block's CRC32 the first time a reader touches it (`check_rows`);
- "full": every block's CRC32 at open.
A corrupt block raises CorruptBlockError naming the file, block, rows and both checksums.
"""

from __future__ import annotations

import threading
import zlib
from pathlib import Path

import numpy as np

from hybridrec.data.manifest import ArraySpec, Manifest

VERIFY = ("size", "read", "full")


class CorruptBlockError(ValueError):
    """A block of a dataset file does not match the manifest (size or checksum)."""


def _header(path: Path) -> tuple[tuple[int, ...], np.dtype, int]:
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }.get(version)
            if read is None:
                raise ValueError(f"unsupported .npy version {version}")
            shape, fortran, dtype = read(f)
        except ValueError as e:
            raise CorruptBlockError(f"{path}: not a readable .npy file ({e})") from None
        if fortran:
            raise CorruptBlockError(f"{path}: Fortran-ordered array; expected C order")
        return shape, dtype, f.tell()


class Dataset:
    """A preprocessed dataset; see the module docstring."""

    def __init__(self, path: str | Path, verify: str = "size") -> None:
        if verify not in VERIFY:
            raise ValueError(f"verify={verify!r} is not one of: {', '.join(VERIFY)}")
        self.path = Path(path)
        self.manifest = Manifest.load(self.path)
        self.verify = verify
        m = self.manifest
        self.num_rows, self.block_rows = m.num_rows, m.block_rows
        for name, (start, end) in m.splits.items():
            if not 0 <= start <= end <= m.num_rows:
                raise ValueError(
                    f"{self.path / 'manifest.json'}: split {name!r} [{start}, {end}) is not "
                    f"within the dataset's {m.num_rows} rows; re-run hybridrec-preprocess"
                )
        self._blocks: dict[str, np.ndarray] = {}
        self._offsets: dict[str, int] = {}
        for name in ("labels", "dense", "categorical"):
            if name not in m.arrays:
                raise ValueError(f"{self.path / 'manifest.json'}: no array {name!r}")
            self._blocks[name] = self._open(name, m.arrays[name])
        n, padded = self.num_rows, m.num_blocks * m.block_rows  # padded, not -1: F may be 0
        self.labels = self._blocks["labels"].reshape(padded)[:n]
        self.dense = self._blocks["dense"].reshape(padded, *m.arrays["dense"].row_shape)[:n]
        self.categorical = self._blocks["categorical"].reshape(
            padded, *m.arrays["categorical"].row_shape
        )[:n]
        self._verified: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        if verify == "full":
            self.verify_checksums()

    def _open(self, name: str, spec: ArraySpec) -> np.ndarray:
        path = self.path / spec.file
        if not path.is_file():
            raise CorruptBlockError(f"{path} is missing (listed in the manifest as {name})")
        shape, dtype, offset = _header(path)
        m = self.manifest
        want = (m.num_blocks, m.block_rows, *spec.row_shape)
        if tuple(shape) != want or dtype != np.dtype(spec.dtype):
            raise CorruptBlockError(
                f"{path}: header says {dtype}{list(shape)}, the manifest {spec.dtype}{list(want)}"
            )
        block_bytes = dtype.itemsize * int(np.prod(want[1:]))
        size, expected = path.stat().st_size, offset + m.num_blocks * block_bytes
        if size != expected:
            first_bad = max(0, (size - offset) // block_bytes)
            raise CorruptBlockError(
                f"{path} is {'truncated' if size < expected else 'too long'}: {size} bytes, "
                f"the manifest implies {expected} ({m.num_blocks} blocks of {block_bytes} bytes "
                f"after a {offset}-byte header); block {first_bad} (rows "
                f"{first_bad * m.block_rows}..) onward is incomplete. Re-run hybridrec-preprocess"
            )
        self._offsets[name] = offset
        return np.load(path, mmap_mode="r", allow_pickle=False)

    # -- splits ---------------------------------------------------------------------------
    def split(self, name: str) -> tuple[int, int]:
        """[start, end) rows of split `name` (train, val or test)."""
        return self.manifest.split_range(name)

    # -- checksums ------------------------------------------------------------------------
    def _check_block(self, name: str, block: int) -> None:
        crcs = self.manifest.arrays[name].block_crc32
        if crcs is None:
            return
        data = np.ascontiguousarray(self._blocks[name][block])
        actual = zlib.crc32(data.tobytes() if data.size == 0 else memoryview(data).cast("B"))
        if actual != crcs[block]:
            path = self.path / self.manifest.arrays[name].file
            r = self.block_rows
            raise CorruptBlockError(
                f"{path}: block {block} (rows {block * r}..{(block + 1) * r - 1}) is corrupt: "
                f"crc32 {actual:#010x}, the manifest says {crcs[block]:#010x}. "
                "Re-run hybridrec-preprocess"
            )

    def verify_checksums(self) -> None:
        """Check every block of every array against the manifest (reads the whole dataset)."""
        for name in self._blocks:
            for b in range(self.manifest.num_blocks):
                self._check_block(name, b)
                self._verified.add((name, b))

    def check_rows(self, start: int, end: int) -> None:
        """With verify='read': check the blocks holding rows [start, end) once each."""
        if self.verify != "read" or end <= start:
            return
        for b in range(start // self.block_rows, (end - 1) // self.block_rows + 1):
            for name in self._blocks:
                if (name, b) in self._verified:
                    continue
                self._check_block(name, b)
                with self._lock:
                    self._verified.add((name, b))

    def file(self, name: str) -> Path:
        return self.path / self.manifest.arrays[name].file

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        s = ", ".join(f"{k}={v[1] - v[0]}" for k, v in self.manifest.splits.items())
        return f"Dataset({str(self.path)!r}, rows={self.num_rows}, {s})"


def open_dataset(path: str | Path, verify: str = "size") -> Dataset:
    """Open the preprocessed dataset in directory `path` (see Dataset)."""
    return Dataset(path, verify)
