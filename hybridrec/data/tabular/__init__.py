"""A user's table (Parquet or CSV/TSV) + a dataset spec -> a binary dataset directory.

`preprocess_table(spec, inputs, output)` is what `hybridrec-preprocess --spec` runs. It writes
the directory format the Criteo preprocessing writes (hybridrec.data.manifest), so readers,
loaders, shuffling and checksums work unchanged: labels.npy, dense.npy, categorical.npy,
counts/ (hybridrec.data.tabular.write) and manifest.json, last and atomically.

Two streamed passes over the inputs (hybridrec.data.tabular.scan), in file order:
1. the train split's statistics: vocabularies (one per table: features sharing a table share
   it), standardize's mean and std, the longest list;
2. encode every row (hybridrec.data.tabular.encode) into per-split parts, then assemble.
Memory: one batch of `batch_rows` rows plus the vocabularies and a count per table row.
`stats_from` (`--stats-from DIR`): `standardize` uses the mean and standard deviation another
dataset applied (yesterday's, made with the same spec) instead of this train split's, so one
raw value gives one input day after day; both are recorded (hybridrec.data.dense_stats).
A run whose inputs, spec and options match the directory's fingerprint does nothing; another
dataset there needs `overwrite`. The dataset is built beside the output and swapped in when
complete (hybridrec.data.preprocess.output): a run that fails or is interrupted leaves the
output as it was and nothing else behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hybridrec.data.dense_stats import dense_stats
from hybridrec.data.manifest import FORMAT, MANIFEST, VERSION, Manifest, SourceFile
from hybridrec.data.preprocess.options import UsageError
from hybridrec.data.preprocess.output import building, check_output, clear_partial
from hybridrec.data.spec import DatasetSpec
from hybridrec.data.tabular import columns
from hybridrec.data.tabular.encode import check_shared_values, feature_line, make_features
from hybridrec.data.tabular.scan import Splitter, Table, open_table
from hybridrec.data.tabular.write import Moments, SplitParts, write_counts

__all__ = ["TableReport", "preprocess_table"]


@dataclass
class TableReport:
    manifest: Manifest
    up_to_date: bool = False
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)  # one per label, dense and sparse feature


def _fingerprint(
    table: Table, spec: DatasetSpec, block_rows: int, checksums: bool, stats: StatsFrom | None
) -> str:
    files = []
    for _, frag in table.fragments():
        st = Path(frag.path).stat()
        files.append((frag.path, st.st_size, st.st_mtime_ns))
    ident: dict = {
        "format": [FORMAT, VERSION, "table"],
        "spec": spec.fingerprint(),
        "options": [block_rows, checksums],
        "inputs": files,
    }
    if stats is not None:  # only then: a dataset made without keeps its fingerprint
        ident["stats_from"] = sorted(stats.stats.items())
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class StatsFrom:
    """`standardize` statistics taken from another dataset: its path and fingerprint, and
    per standardize column of the spec, (mean, std) as that dataset applied them."""

    path: str
    fingerprint: str
    stats: dict[str, tuple[float, float]]


def load_stats_from(path: str | Path, spec: DatasetSpec) -> StatsFrom:
    """The statistics of dataset `path` for the spec's standardize columns; UsageError (one
    line naming the path and the column) when it is no spec dataset or lacks one of them."""
    try:
        m = Manifest.load(path)
    except ValueError as e:
        raise UsageError(f"--stats-from {path}: {e}") from None
    given = {c["column"]: c for c in dense_stats(m) or []}
    out = {}
    for d in spec.dense:
        if d.transform != "standardize":
            continue
        c = given.get(d.column)
        if c is None or c["transform"] != "standardize":
            has = ", ".join(f"{k} ({v['transform']})" for k, v in given.items()) or "none"
            raise UsageError(
                f"--stats-from {path}: the dataset has no standardize statistics of dense column "
                f"{d.column!r} (its dense columns: {has}); give a dataset preprocessed with this "
                "spec"
            )
        out[d.column] = (c["mean"], c["std"])
    return StatsFrom(str(Path(path).resolve()), m.fingerprint, out)


def preprocess_table(
    spec: DatasetSpec,
    inputs: list[str | Path],
    output: str | Path,
    block_rows: int = 16384,
    checksums: bool = True,
    overwrite: bool = False,
    batch_rows: int = 65536,
    stats_from: str | Path | None = None,
) -> TableReport:
    """Build (or confirm) the dataset in `output`; see the module docstring."""
    t0 = time.perf_counter()
    if block_rows < 1 or batch_rows < 1:
        raise UsageError(f"block_rows and batch_rows must be >= 1, got {block_rows}, {batch_rows}")
    stats = load_stats_from(stats_from, spec) if stats_from is not None else None
    table = open_table(inputs, spec)
    output = Path(output)
    check_output(output)
    fp = _fingerprint(table, spec, block_rows, checksums, stats)
    if (output / MANIFEST).is_file():
        old = Manifest.load(output)
        if old.fingerprint == fp:
            return TableReport(old, up_to_date=True)
        if not overwrite:
            raise UsageError(
                f"{output} already holds a dataset built from other inputs, spec or options "
                f"(fingerprint {old.fingerprint}, now {fp}); pass --overwrite to replace it"
            )
    with building(output) as partial:  # swapped in when complete; removed on any failure
        clear_partial(partial)  # what an interrupted run left
        work = partial / ".work"
        work.mkdir()
        report = _build(table, spec, partial, work, fp, block_rows, checksums, batch_rows, stats)
        shutil.rmtree(work)
    report.seconds = time.perf_counter() - t0
    return report


def _build(
    table: Table,
    spec: DatasetSpec,
    output: Path,
    work: Path,
    fp: str,
    block_rows: int,
    checksums: bool,
    batch_rows: int,
    stats: StatsFrom | None,
) -> TableReport:
    total = table.count_rows() if spec.split.by == "rows" else None
    features = make_features(spec)
    cols = spec.columns()

    # 1. train statistics
    moments = [Moments() for _ in spec.dense]
    splitter = Splitter(spec.split, total)
    for file, row0, batch in table.batches(cols, batch_rows):
        train = splitter.codes(batch) == 0
        for d, m in zip(spec.dense, moments, strict=True):
            values, _, _ = columns.dense(columns.plain(batch.column(d.column)), d, file, row0)
            m.add(values[train])
        for f in features:
            col = columns.plain(batch.column(f.spec.column))
            f.count(columns.bags(col, f.spec, f.index, file, row0), train)
    for d, m in zip(spec.dense, moments, strict=True):
        if d.transform == "standardize" and not (np.isfinite(m.mean) and np.isfinite(m.std)):
            raise ValueError(
                f"dense column {d.column!r}: its train mean and standard deviation overflow "
                "(values near the float64 limit); rescale it or use transform: log1p"
            )
    # the (mean, std) each column is standardized with: this train split's, or --stats-from's
    applied = [
        stats.stats[d.column] if stats and d.column in stats.stats else (m.mean, m.std)
        for d, m in zip(spec.dense, moments, strict=True)
    ]
    check_shared_values(features)
    for f in features:
        f.finish_counting()
    big = max(f.num_embeddings for f in features) >= 2**31
    big |= any(f.spec.encoding == "dynamic" for f in features)  # raw ids: int64 end to end
    hot = sum(f.max_len for f in features)
    parts = SplitParts(
        work,
        {"labels": (), "dense": (len(spec.dense),), "categorical": (hot,)},
        {"labels": "float32", "dense": "float32", "categorical": "int64" if big else "int32"},
    )

    # 2. encode every row into its split's part
    splitter = Splitter(spec.split, total)
    dense_nulls = [0] * len(spec.dense)
    dense_nans = [0] * len(spec.dense)
    sources: dict[str, list[int]] = {}  # file -> [kept rows, train rows, rows in no split]
    try:
        for file, row0, batch in table.batches(cols, batch_rows):
            codes = splitter.codes(batch)
            keep = codes >= 0
            src = sources.setdefault(file, [0, 0, 0])
            src[0] += int(keep.sum())
            src[1] += int((codes == 0).sum())
            src[2] += int((~keep).sum())
            labels = columns.labels(
                columns.plain(batch.column(spec.label.column)), spec.label, file, row0
            )
            dense = np.zeros((batch.num_rows, len(spec.dense)), np.float32)
            for k, (d, (mean, std)) in enumerate(zip(spec.dense, applied, strict=True)):
                col = columns.plain(batch.column(d.column))
                values, nulls, nans = columns.dense(col, d, file, row0)
                dense[:, k] = columns.transform(values, d.transform, mean, std)
                columns.check_finite(dense[:, k], values, d, file, row0)
                dense_nulls[k] += int(nulls[keep].sum())
                dense_nans[k] += int(nans[keep].sum())
            ids = [
                f.encode(
                    columns.bags(
                        columns.plain(batch.column(f.spec.column)), f.spec, f.index, file, row0
                    ),
                    codes,
                    file,
                    row0,
                )
                for f in features
            ]
            kept = codes[keep]
            parts.add(
                kept,
                {
                    "labels": labels[keep],
                    "dense": dense[keep],
                    "categorical": np.concatenate(ids, axis=1),
                },
            )
    finally:
        parts.close()
    num_rows = sum(parts.rows.values())
    if parts.rows["train"] == 0:
        raise ValueError(
            f"no rows in the train split (of {num_rows} rows in any split); check split in the spec"
        )

    # 3. assemble; manifest.json last
    arrays = parts.assemble(output, block_rows, checksums)
    tables = write_counts(output, features)
    described = [f.describe() for f in features]
    dense_desc = []
    dense_lines = zip(spec.dense, moments, applied, dense_nulls, dense_nans, strict=True)
    for d, m, (mean, std), nulls, nans in dense_lines:
        rule = {"none": "x", "log1p": "log(1 + max(x, 0))"}.get(
            d.transform, f"(x - {mean!r}) / {std if std > 0 else 1.0!r}"
        )
        desc = {
            "column": d.column,
            "transform": d.transform,
            "rule": rule,
            "train_mean": mean,  # the statistics applied (hybridrec.data.dense_stats)
            "train_std": std,
            "nulls": nulls,  # empty cells and NaN
            "nans": nans,
        }
        if stats is not None and d.column in stats.stats:  # and this train split's own
            desc.update(stats_from=stats.path, own_mean=m.mean, own_std=m.std)
        dense_desc.append(desc)
    label = spec.label
    label_rule = (
        f"{label.column} {label.rule['op']} {label.rule['value']!r} -> 1 else 0"
        if (label.rule)
        else ("0/1" if label.task == "binary" else "the value")
    )
    manifest = Manifest(
        num_rows=num_rows,
        block_rows=block_rows,
        splits=parts.splits(),
        arrays=arrays,
        tables=tables,
        schema={
            "raw": f"{table.format} table: {', '.join(str(p) for p in table.paths)}",
            "labels": {
                "fields": [label.column],
                "task": label.task,
                "dtype": "float32",
                "shape": ["N"],
            },
            "dense": {
                "fields": [d.column for d in spec.dense],
                "dtype": "float32",
                "shape": ["N", len(spec.dense)],
                "columns": dense_desc,
            },
            "categorical": {
                "fields": [f.spec.column for f in features],
                "tables": [f.table.name for f in features],
                "hotness": [d["hotness"] for d in described],
                "dtype": arrays["categorical"].dtype,
                "shape": ["N", hot],
            },
            "layout": "each .npy is [num_blocks, block_rows, ...]; rows >= num_rows are zero "
            "padding; a table's id columns are padded with -1 after a list's ids",
        },
        encoding={
            "kind": "spec",
            "rule": "per feature, see docs/data-spec.md: vocabulary 0 = null, 1 = out of "
            "vocabulary, 2.. by train count; hashing 0 = null; identity null = rows; dynamic raw "
            "int64 ids (strings hashed), null = 2^63 - 2",
            "counted_on": "train",
        },
        transforms={
            "label": f"{label.task}: {label_rule}, stored float32",
            "dense": "null or NaN -> 0, then each column's transform (schema.dense.columns)",
            "categorical": "see encoding; lists padded with -1",
        },
        sources=[
            SourceFile(file, Path(file).stat().st_size, v[0], v[1], v[2])
            for file, v in sources.items()
        ],
        options={
            "block_rows": block_rows,
            "checksums": checksums,
            "spec_fingerprint": spec.fingerprint(),
            **(
                {"stats_from": {"path": stats.path, "fingerprint": stats.fingerprint}}
                if stats is not None
                else {}
            ),
        },
        fingerprint=fp,
        skipped_rows=sum(v[2] for v in sources.values()),
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        spec=spec.to_dict(),
        features=described,
    )
    manifest.save(output)
    lines = [f"{label.column}: label ({label.task}: {label_rule}), {num_rows} rows"]
    for d in dense_desc:
        nan = f" ({d['nans']} of them NaN)" if d["nans"] else ""
        how = d["transform"]
        if "stats_from" in d:
            how += (
                f" with mean {d['train_mean']:.6g}, std {d['train_std']:.6g} from "
                f"{d['stats_from']}; this train split's: {d['own_mean']:.6g}, {d['own_std']:.6g}"
            )
        lines.append(f"{d['column']}: dense ({how}), {num_rows} rows, {d['nulls']} nulls{nan}")
    lines += [feature_line(d) for d in described]
    return TableReport(manifest, lines=lines)
