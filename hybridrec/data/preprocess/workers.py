"""The per-file work, in worker processes: count values (vocab pass 1), encode (pass 2).

`_run_tasks` runs one function over the files' FileTasks, skipping files already committed
(a part directory whose meta.json carries this run's fingerprint), in spawned processes when
workers > 1. Workers report (bytes, rows) to a progress queue and stop early when another
file failed (a shared event). Worker functions are top-level here so they pickle by name.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

from hybridrec.data.criteo import NUM_CAT, RawChunk, TsvReader, dense_transform
from hybridrec.data.encode import HashEncoder, SparseCounter, VocabEncoder
from hybridrec.data.preprocess.options import ARRAYS, DENSE_COUNTER_MAX, PreprocessCancelled
from hybridrec.data.preprocess.plan import FileTask

log = logging.getLogger("hybridrec")

_progress: Any = None  # a multiprocessing queue of (bytes, rows), set per worker process
_stop: Any = None  # a multiprocessing event: another file failed


def _init_worker(progress: Any, stop: Any) -> None:
    global _progress, _stop
    _progress, _stop = progress, stop
    os.environ.setdefault("OMP_NUM_THREADS", "1")


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
