"""Raw Criteo day files -> a binary dataset directory (what `hybridrec-preprocess` runs).

In: TSV day files (plain or gzip; files, or directories of them, in natural order: day_2
before day_10) and PreprocessOptions. Out: in `output`, labels.npy, dense.npy and
categorical.npy ([num_blocks, block_rows, ...], rows in split order train | val | test,
optional CRC32 per block), counts/cat_<t>.npz (train id frequencies) and manifest.json.
Streaming: files are parsed in pyarrow blocks, one file per worker process; memory depends
on chunk_bytes and the number of distinct ids, never on the number of rows.
Never in place: the dataset is built in `.<name>.partial/` beside `output` and swapped in
when complete (hybridrec.data.preprocess.output), so a run that fails or is interrupted
leaves `output` as it was (the previous dataset, with --overwrite). Resumable: per-file
work goes to `.work/` there, keyed by a fingerprint of the inputs (name, size, mtime) and
the output options; a rerun after an interruption redoes only the files not yet committed,
and a rerun over a finished directory with the same fingerprint does nothing. A run that
fails (an exception) removes the partial directory (kept with keep_work); an interrupted
one keeps it. manifest.json goes last, so its presence marks a finished dataset. Stages:
plan -> workers (count, encode) -> vocab -> assemble. The output format, options and the
measured memory bound: docs/preprocessing.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from hybridrec.data.manifest import MANIFEST, Manifest, SourceFile
from hybridrec.data.preprocess.assemble import (
    BlockCrc,
    _assemble_array,
    _encoding,
    _schema,
    _write_counts,
    write_npy_header,
)
from hybridrec.data.preprocess.options import (
    ARRAYS,
    MLPERF_CAP,
    PreprocessCancelled,
    PreprocessOptions,
    PreprocessReport,
    UsageError,
)
from hybridrec.data.preprocess.output import building, check_output, clear_partial
from hybridrec.data.preprocess.plan import FileTask, _train_limits, fingerprint, list_inputs
from hybridrec.data.preprocess.vocab import _build_vocabs, _merge_hash_counts
from hybridrec.data.preprocess.workers import _done, _run_tasks, count_values, encode_file

__all__ = [
    "ARRAYS",
    "MLPERF_CAP",
    "BlockCrc",
    "FileTask",
    "PreprocessCancelled",
    "PreprocessOptions",
    "PreprocessReport",
    "UsageError",
    "count_values",
    "encode_file",
    "fingerprint",
    "list_inputs",
    "preprocess",
    "write_npy_header",
]

log = logging.getLogger("hybridrec")


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
    # 0. An up-to-date output is confirmed; another dataset there needs `overwrite`.
    t0 = time.perf_counter()
    options = options or PreprocessOptions()
    files = list_inputs(inputs)
    output = Path(output)
    check_output(output)
    fp = fingerprint(files, options)
    if (output / MANIFEST).is_file():
        old = Manifest.load(output)
        if old.fingerprint == fp:
            log.debug("%s is up to date (fingerprint %s)", output, fp)  # the caller says so
            return PreprocessReport(old, up_to_date=True)
        if not overwrite:
            raise UsageError(
                f"{output} already holds a dataset built from other inputs or options "
                f"(fingerprint {old.fingerprint}, now {fp}); pass --overwrite to replace it"
            )
    # 1-4 in the partial directory beside the output, swapped in when complete: a failed run
    # removes it (fixing the input changes the fingerprint, so its parts could not be reused
    # anyway), an interrupted one (Ctrl-C) keeps its .work/ to resume.
    with building(output, keep_work=keep_work, resumable=True) as partial:
        work = partial / ".work"
        stamp = work / "fingerprint"
        if work.exists() and (not stamp.is_file() or stamp.read_text() != fp):
            log.info("discarding %s: it was made for other inputs or options", work)
            shutil.rmtree(work)
        clear_partial(partial, keep=".work")
        work.mkdir(exist_ok=True)
        stamp.write_text(fp)
        report = _build(files, partial, work, fp, options, workers, progress)
        if not keep_work:
            shutil.rmtree(work)
    report.seconds = time.perf_counter() - t0
    return report


def _build(
    files: list[Path],
    output: Path,
    work: Path,
    fp: str,
    options: PreprocessOptions,
    workers: int | None,
    progress: bool,
) -> PreprocessReport:
    """Stages 1-4 of `preprocess` in `work`; returns the report (seconds left at 0)."""
    workers = workers or min(len(files), os.cpu_count() or 1)

    # 1. Plan: each file's train rows. 2. Vocabularies (vocab only): count, then merge.
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

    # 3. Encode every file to its part under .work/parts/ (files already committed are kept).
    tasks = [
        FileTask(str(f), str(work / "parts" / n), lim, options, fp, vocab_dir)
        for f, n, lim in zip(files, names, limits, strict=True)
    ]
    reused = sum(_done(Path(t.work), fp) is not None for t in tasks)
    metas = _run_tasks(encode_file, tasks, workers, progress, "encode")
    parts = [Path(t.work) for t in tasks]
    if options.encoding == "hash":
        _merge_hash_counts(work, parts)

    # 4. Assemble: train rows of every file, then the held-out rows (halved: val | test).
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
    tables = _write_counts(work, output, sizes)
    # manifest.json last: its presence marks the directory complete
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
    examples = [e for m in metas for e in m.get("examples", [])]
    return PreprocessReport(manifest, False, reused, 0.0, examples)
