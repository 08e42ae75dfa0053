"""Raw Criteo day files -> a binary dataset directory (what `hybridrec-preprocess` runs).

1. **Plan.** Inputs are sorted in natural order (day_2 before day_10). Each file gets a train
   limit: with `split="days"` (MLPerf) the last `holdout_days` files are held out and every
   other file is all train; with `split="rows"` the first floor(train_fraction * lines) rows
   of every file are train (lines are counted first). All held-out rows, in file order, are
   halved: the first half is the validation split, the second half the test split.
2. **Vocabularies** (encoding="vocab" only). Pass 1 counts every categorical value of the
   train rows, per file in parallel; then, one table at a time, the files' counts are merged
   and values seen at least `min_count` times are kept (hybridrec.data.encode).
3. **Encode**, per file in parallel (spawned processes, one file each): pyarrow streams the
   file in blocks (hybridrec.data.criteo), ids are encoded, dense features transformed with
   log(1 + max(x, 0)) *at write* (stored float32, so readers only copy), and the rows are
   appended to the file's part in `.work/parts/`. A part is committed by writing its meta
   file last: a rerun after a crash redoes only the files without one (resumable per day
   file), and a rerun over a finished directory with the same inputs and options does
   nothing (idempotent; the fingerprint covers every input's name, size and mtime and every
   option that changes the output).
4. **Assemble.** The parts are concatenated in split order (train | val | test) into
   `labels.npy` [num_blocks, block_rows] uint8, `dense.npy` [num_blocks, block_rows, 13]
   float32 and `categorical.npy` [num_blocks, block_rows, 26] int32 (the last block zero-padded;
   optional CRC32 per block), train id frequencies go to `counts/cat_<t>.npz`, and
   `manifest.json` is written last. The work directory is then removed.

Memory bound: it depends on the chunk size and on how many distinct ids there are (at most
the table sizes), never on the number of rows. Per worker process:
    ~40 x chunk_bytes       pyarrow's CSV reader holds this much per block (measured: ~150 MiB
                            at the default 4 MiB), plus ~10 x chunk_bytes of decoded arrays
  + 16-32 bytes x distinct (table, id) pairs in the file's train rows (hash-mode id counts;
                            a table with cap <= 2^22 uses one dense 8-byte counter per row),
                            or distinct (table, raw value) pairs in vocab pass 1
and in the parent ~48 bytes x the distinct values of one table while it merges counts (one
table at a time). Vocabularies are memory-mapped by the workers, never copied.
Measured (peak RSS summed over the parent and 2 workers on a 2-core VM; fake Criteo rows with
up to 200k distinct values per table): 2.0 GB of TSV -> 688 MiB; 4.1 GB (16.8M rows, 4 files)
-> 744 MiB with hash encoding, 734 MiB with vocab; the largest process 341 MiB. Commands and
details: benchmarks/results/data_loader.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import re
import shutil
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hybridrec.data.criteo import (
    FIELD_NAMES,
    NUM_CAT,
    NUM_DENSE,
    RawChunk,
    TsvReader,
    count_lines,
    dense_transform,
)
from hybridrec.data.encode import (
    MISSING_ID,
    RARE_ID,
    HashEncoder,
    SparseCounter,
    VocabEncoder,
    build_vocab,
)
from hybridrec.data.manifest import (
    FORMAT,
    MANIFEST,
    VERSION,
    ArraySpec,
    Manifest,
    SourceFile,
    TableStats,
)

log = logging.getLogger("hybridrec")

MLPERF_CAP = 40_000_000
DENSE_COUNTER_MAX = 1 << 22  # hash tables up to this many rows are counted densely
TOP_IDS = 10
# name -> (dtype, per-row shape): the three arrays of a dataset
ARRAYS: dict[str, tuple[str, tuple[int, ...]]] = {
    "labels": ("uint8", ()),
    "dense": ("float32", (NUM_DENSE,)),
    "categorical": ("int32", (NUM_CAT,)),
}


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
        def bad(key: str, value: object, want: str) -> ValueError:
            return ValueError(f"preprocess option {key}={value!r}: {want}")

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


# -- inputs and plan --------------------------------------------------------------------------


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
                raise ValueError(f"input directory {p} holds no files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"input {p} does not exist")
    if not files:
        raise ValueError("no input files given")
    return sorted(files, key=lambda f: _natural_key(f.name)) if len(inputs) > 1 else files


def fingerprint(files: Sequence[Path], options: PreprocessOptions) -> str:
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
            raise ValueError(
                f"split=days holds out the last {options.holdout_days} file(s) but only "
                f"{len(files)} input file(s) were given; use split=rows (train_fraction) or "
                "fewer holdout_days (hybridrec-preprocess: --split rows --train-fraction F, or "
                "--holdout-days N)"
            )
        n_train = len(files) - options.holdout_days
        return [-1 if i < n_train else 0 for i in range(len(files))]
    return [math.floor(options.train_fraction * count_lines(f)) for f in files]


# -- workers ----------------------------------------------------------------------------------

_progress: Any = None  # a multiprocessing queue of (bytes, rows), set per worker process
_stop: Any = None  # a multiprocessing event: another file failed


def _init_worker(progress: Any, stop: Any) -> None:
    global _progress, _stop
    _progress, _stop = progress, stop
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@dataclass(frozen=True)
class FileTask:
    path: str
    work: str  # this file's directory under .work/
    train_limit: int  # -1 = all rows are train
    options: PreprocessOptions
    fingerprint: str
    vocab_dir: str | None = None


def _reader(task: FileTask) -> TsvReader:
    return TsvReader(task.path, task.options.chunk_bytes, task.options.on_error)


def _chunks(task: FileTask, reader: TsvReader) -> Iterator[tuple[RawChunk, int]]:
    """The file's chunks with how many of their first rows are train; reports progress."""
    done_bytes = 0
    for chunk in reader:
        if _stop is not None and _stop.is_set():
            raise PreprocessCancelled(task.path)
        if task.train_limit < 0:
            n_train = len(chunk)
        else:
            n_train = int(np.clip(task.train_limit - (reader.rows - len(chunk)), 0, len(chunk)))
        yield chunk, n_train
        if _progress is not None:
            _progress.put((reader.bytes_read - done_bytes, len(chunk)))
            done_bytes = reader.bytes_read
    if _progress is not None:
        _progress.put((reader.bytes_read - done_bytes, 0))


def _file_meta(task: FileTask, reader: TsvReader, train_rows: int) -> dict[str, Any]:
    return {
        "fingerprint": task.fingerprint,
        "file": Path(task.path).name,
        "bytes": Path(task.path).stat().st_size,
        "rows": reader.rows,
        "train_rows": train_rows,
        "skipped_rows": reader.skipped,
        "examples": reader.examples,
    }


def _commit(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    tmp = directory / "meta.json.tmp"
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, directory / "meta.json")
    return meta


def count_values(task: FileTask) -> dict[str, Any]:
    """Vocab pass 1: every categorical value's count in this file's train rows."""
    out = Path(task.work)
    out.mkdir(parents=True, exist_ok=True)
    counters = [SparseCounter(np.uint64) for _ in range(NUM_CAT)]
    missing = np.zeros(NUM_CAT, np.int64)
    train_rows = 0
    reader = _reader(task)
    for chunk, n_train in _chunks(task, reader):
        train_rows += n_train
        cat, miss = chunk.cat[:n_train], chunk.missing[:n_train]
        missing += miss.sum(0)
        for t in range(NUM_CAT):
            counters[t].add(cat[~miss[:, t], t])
    arrays: dict[str, np.ndarray] = {"missing": missing}
    for t, c in enumerate(counters):
        arrays[f"values_{t}"], arrays[f"counts_{t}"] = c.result()
    np.savez(out / "values.npz", **arrays)
    return _commit(out, _file_meta(task, reader, train_rows))


class _IdCounter:
    """Train id counts of one hash-encoded table: dense for small caps, sparse otherwise."""

    def __init__(self, cap: int) -> None:
        self.dense = np.zeros(cap, np.int64) if cap <= DENSE_COUNTER_MAX else None
        self.sparse = SparseCounter(np.int64) if self.dense is None else None

    def add(self, ids: np.ndarray) -> None:
        if self.dense is not None:
            self.dense += np.bincount(ids, minlength=self.dense.size)
        else:
            self.sparse.add(ids.astype(np.int64))

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        if self.dense is not None:
            ids = np.flatnonzero(self.dense)
            return ids.astype(np.int64), self.dense[ids]
        return self.sparse.result()


def encode_file(task: FileTask) -> dict[str, Any]:
    """Pass 2: parse, encode and append one input file to its part (then commit it)."""
    out = Path(task.work)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    opts = task.options
    if opts.encoding == "hash":
        encoder: HashEncoder | VocabEncoder = HashEncoder(opts.caps())
        counters = [_IdCounter(c) for c in opts.caps()]
    else:
        encoder = VocabEncoder(Path(task.vocab_dir or ""), NUM_CAT)
        counters = []
    files = {name: open(out / f"{name}.bin", "wb") for name in ARRAYS}  # noqa: SIM115
    train_rows = 0
    try:
        reader = _reader(task)
        for chunk, n_train in _chunks(task, reader):
            ids = encoder.encode(chunk.cat, chunk.missing)
            files["labels"].write(chunk.labels.tobytes())
            files["dense"].write(dense_transform(chunk.dense).tobytes())
            files["categorical"].write(ids.tobytes())
            train_rows += n_train
            for t, counter in enumerate(counters):
                counter.add(ids[:n_train, t])
    finally:
        for f in files.values():
            f.close()
    if counters:
        arrays: dict[str, np.ndarray] = {}
        for t, counter in enumerate(counters):
            arrays[f"ids_{t}"], arrays[f"counts_{t}"] = counter.result()
        np.savez(out / "counts.npz", **arrays)
    return _commit(out, _file_meta(task, reader, train_rows))


def _done(directory: Path, fp: str) -> dict[str, Any] | None:
    meta = directory / "meta.json"
    if not meta.is_file():
        return None
    try:
        d = json.loads(meta.read_text())
    except json.JSONDecodeError:
        return None
    return d if d.get("fingerprint") == fp else None


def _run_tasks(
    fn: Callable[[FileTask], dict[str, Any]],
    tasks: list[FileTask],
    workers: int,
    progress: bool,
    desc: str,
) -> list[dict[str, Any]]:
    """Run fn over tasks, skipping committed ones; in spawned processes when workers > 1."""
    results: list[dict[str, Any] | None] = [_done(Path(t.work), t.fingerprint) for t in tasks]
    todo = [i for i, r in enumerate(results) if r is None]
    if len(todo) < len(tasks):
        log.info(
            "%s: %d of %d files already done (resuming)", desc, len(tasks) - len(todo), len(tasks)
        )
    if not todo:
        return results  # type: ignore[return-value]
    from tqdm import tqdm

    total = sum(Path(tasks[i].path).stat().st_size for i in todo)
    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not progress)
    rows = 0
    ctx = mp.get_context("spawn")
    if workers <= 1 or len(todo) == 1:
        q: Any = queue.SimpleQueue()
        _init_worker(q, None)
        try:
            for i in todo:
                results[i] = fn(tasks[i])
                while not q.empty():
                    nbytes, n = q.get()
                    rows += n
                    bar.update(nbytes)
        finally:
            _init_worker(None, None)
            bar.close()
        return results  # type: ignore[return-value]
    q, stop = ctx.Queue(), ctx.Event()
    with ProcessPoolExecutor(
        min(workers, len(todo)), mp_context=ctx, initializer=_init_worker, initargs=(q, stop)
    ) as pool:
        futures = {pool.submit(fn, tasks[i]): i for i in todo}
        pending = set(futures)
        try:
            while pending:
                finished, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
                for fut in finished:
                    results[futures[fut]] = fut.result()  # re-raises a worker's error
                while True:
                    try:
                        nbytes, n = q.get_nowait()
                    except queue.Empty:
                        break
                    rows += n
                    bar.update(nbytes)
                    bar.set_postfix(rows=f"{rows:,}")
        except BaseException:
            stop.set()
            for fut in pending:
                fut.cancel()
            raise
        finally:
            bar.close()
    return results  # type: ignore[return-value]


# -- vocabularies and counts ------------------------------------------------------------------


def _top(ids: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    order = np.lexsort((ids, -counts))[:TOP_IDS]
    return [[int(ids[i]), int(counts[i])] for i in order]


def _build_vocabs(work: Path, metas: list[dict], parts: list[Path], min_count: int) -> list[int]:
    """Merge pass-1 counts table by table; write vocabularies and id counts; cardinalities."""
    vocab = work / "vocab"
    vocab.mkdir(exist_ok=True)
    sizes = []
    missing = np.zeros(NUM_CAT, np.int64)
    for p in parts:
        with np.load(p / "values.npz") as z:
            missing += z["missing"]
    for t in range(NUM_CAT):
        counter = SparseCounter(np.uint64)
        for p in parts:
            with np.load(p / "values.npz") as z:
                counter.add_counts(z[f"values_{t}"], z[f"counts_{t}"])
        values, counts = counter.result()
        v = build_vocab(values, counts, min_count)
        np.save(vocab / f"cat_{t}.values.npy", v["values"])
        np.save(vocab / f"cat_{t}.ids.npy", v["ids"].astype(np.int32))
        id_counts = np.concatenate([[missing[t], counts[counts < min_count].sum()], v["counts"]])
        ids = np.flatnonzero(id_counts)
        np.savez(vocab / f"cat_{t}.counts.npz", ids=ids.astype(np.int64), counts=id_counts[ids])
        sizes.append(2 + int(v["values"].size))
    return sizes


def _merge_hash_counts(work: Path, parts: list[Path]) -> None:
    out = work / "vocab"  # same place as vocab mode's counts
    out.mkdir(exist_ok=True)
    for t in range(NUM_CAT):
        counter = SparseCounter(np.int64)
        for p in parts:
            with np.load(p / "counts.npz") as z:
                counter.add_counts(z[f"ids_{t}"], z[f"counts_{t}"])
        ids, counts = counter.result()
        np.savez(out / f"cat_{t}.counts.npz", ids=ids, counts=counts)


# -- assembly ---------------------------------------------------------------------------------


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


# -- the whole run ----------------------------------------------------------------------------


def _clear_output(output: Path) -> None:
    for name in [MANIFEST, *(f"{a}.npy" for a in ARRAYS)]:
        (output / name).unlink(missing_ok=True)
    for d in ("counts", ".work"):
        shutil.rmtree(output / d, ignore_errors=True)


def preprocess(
    inputs: Sequence[str | Path],
    output: str | Path,
    options: PreprocessOptions | None = None,
    workers: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
    keep_work: bool = False,
) -> PreprocessReport:
    """Build (or confirm, or resume) the binary dataset in `output`; see the module docstring."""
    t0 = time.perf_counter()
    options = options or PreprocessOptions()
    files = list_inputs(inputs)
    output = Path(output)
    fp = fingerprint(files, options)
    if (output / MANIFEST).is_file():
        old = Manifest.load(output)
        if old.fingerprint == fp:
            log.info("%s is up to date (fingerprint %s)", output, fp)
            return PreprocessReport(old, up_to_date=True)
        if not overwrite:
            raise ValueError(
                f"{output} already holds a dataset built from other inputs or options "
                f"(fingerprint {old.fingerprint}, now {fp}); pass --overwrite to replace it"
            )
        _clear_output(output)
    output.mkdir(parents=True, exist_ok=True)
    work = output / ".work"
    stamp = work / "fingerprint"
    if work.exists() and (not stamp.is_file() or stamp.read_text() != fp):
        log.info("discarding %s: it was made for other inputs or options", work)
        shutil.rmtree(work)
    work.mkdir(exist_ok=True)
    stamp.write_text(fp)
    workers = workers or min(len(files), os.cpu_count() or 1)

    limits = _train_limits(files, options)
    names = [f"{i:04d}_{f.name}" for i, f in enumerate(files)]
    vocab_dir = None
    if options.encoding == "vocab":
        count_tasks = [
            FileTask(str(f), str(work / "count" / n), lim, options, fp)
            for f, n, lim in zip(files, names, limits, strict=True)
        ]
        counted = _run_tasks(count_values, count_tasks, workers, progress, "count values")
        vocab_dir = str(work / "vocab")
        sizes_file = work / "vocab" / "sizes.json"
        if sizes_file.is_file() and json.loads(sizes_file.read_text())["fingerprint"] == fp:
            sizes = json.loads(sizes_file.read_text())["sizes"]
        else:
            sizes = _build_vocabs(
                work, counted, [Path(t.work) for t in count_tasks], options.min_count
            )
            sizes_file.write_text(json.dumps({"fingerprint": fp, "sizes": sizes}))
    else:
        sizes = options.caps()
    tasks = [
        FileTask(str(f), str(work / "parts" / n), lim, options, fp, vocab_dir)
        for f, n, lim in zip(files, names, limits, strict=True)
    ]
    reused = sum(_done(Path(t.work), fp) is not None for t in tasks)
    metas = _run_tasks(encode_file, tasks, workers, progress, "encode")
    parts = [Path(t.work) for t in tasks]
    if options.encoding == "hash":
        _merge_hash_counts(work, parts)

    num_rows = sum(m["rows"] for m in metas)
    if num_rows == 0:
        raise ValueError(
            f"no rows to write: the inputs {[str(f) for f in files]} hold no good rows"
        )
    n_train = sum(m["train_rows"] for m in metas)
    n_val = (num_rows - n_train) // 2
    splits = {
        "train": [0, n_train],
        "val": [n_train, n_train + n_val],
        "test": [n_train + n_val, num_rows],
    }
    ranges = [(p, 0, m["train_rows"]) for p, m in zip(parts, metas, strict=True)]
    ranges += [(p, m["train_rows"], m["rows"]) for p, m in zip(parts, metas, strict=True)]
    arrays = {
        name: _assemble_array(
            output / f"{name}.npy", name, ranges, num_rows, options.block_rows, options.checksums
        )
        for name in ARRAYS
    }
    (output / "counts").mkdir(exist_ok=True)
    tables = []
    for t in range(NUM_CAT):
        src = work / "vocab" / f"cat_{t}.counts.npz"
        dst = output / "counts" / f"cat_{t}.npz"
        shutil.copyfile(src, dst)
        with np.load(dst) as z:
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
    manifest = Manifest(
        num_rows=num_rows,
        block_rows=options.block_rows,
        splits=splits,
        arrays=arrays,
        tables=tables,
        schema=_schema(),
        encoding=_encoding(options),
        transforms={
            "label": "0/1 -> uint8",
            "dense": "log(1 + max(x, 0)), empty -> 0; applied at write, stored float32",
            "categorical": "see encoding; stored int32",
        },
        sources=[
            SourceFile(m["file"], m["bytes"], m["rows"], m["train_rows"], m["skipped_rows"])
            for m in metas
        ],
        options=options.output_options(),
        fingerprint=fp,
        skipped_rows=sum(m["skipped_rows"] for m in metas),
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    manifest.save(output)
    if not keep_work:
        shutil.rmtree(work)
    examples = [e for m in metas for e in m.get("examples", [])]
    return PreprocessReport(manifest, False, reused, time.perf_counter() - t0, examples)


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
