"""Preprocessed Criteo data as a batch source, and the `criteo` / `criteo_sample` data configs.

BinarySource serves global batches of a dataset's splits by step (hybridrec.data.loader's
BatchSource, all of it: rank slices read alone, split sizes, the manifest's id counts and dense
names, and the dataset row of any sample for error messages). The
split the trainer calls "eval" is `data.eval_split` (val by default). The train split repeats
over epochs (reshuffled each epoch); other splits end after one epoch (an IndexError past it;
the loaders stop there).

`open_source(cfg)`:
- data.name=criteo: opens the preprocessed directory `data.path`;
- data.name=table: the same, for a directory made from a dataset spec (the model's tables
  were filled from its manifest by hybridrec.data.table_model);
- data.name=criteo_sample: the raw TSV `data.path` (default: $HYBRIDREC_CRITEO_SAMPLE; the
  file is not in the repository, and nothing outside it is read unless named) is
  preprocessed with `data.preprocess` into
  `<cache>/criteo_sample-<key>/` on first use, cache = data.cache_dir, else $HYBRIDREC_CACHE,
  else ~/.cache/hybridrec; key = hash of the file's bytes and the options. Concurrent ranks
  each build into a private temp dir and rename it into place; the first one wins.
Then the dataset's tables are checked against the model config *before* anything is built:
a different number of tables or dense features, multi-hot tables (unless data.multi_hot=
synthetic expands the one-hot ids, hybridrec.data.multihot), or a table whose cardinality
differs is a ValueError naming the table and giving the override that fits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hybridrec.config import Config, ModelConfig
from hybridrec.data.dataset import Dataset, open_dataset
from hybridrec.data.loader import BatchSource
from hybridrec.data.manifest import MANIFEST, VERSION, Manifest
from hybridrec.data.multihot import SyntheticMultiHot
from hybridrec.data.order import BatchPlan
from hybridrec.data.readers import make_reader
from hybridrec.types import Batch

log = logging.getLogger("hybridrec")

SAMPLE_ENV = "HYBRIDREC_CRITEO_SAMPLE"
CACHE_ENV = "HYBRIDREC_CACHE"


class BinarySource(BatchSource):
    """Global batches of a preprocessed dataset, by step; see the module docstring."""

    def __init__(
        self,
        dataset: Dataset,
        reader: str = "memmap",
        seed: int = 0,
        shuffle: bool = True,
        last_batch: str = "drop",
        eval_split: str = "val",
        dali_device: str = "cpu",
        multi_hot: SyntheticMultiHot | None = None,
    ) -> None:
        self.dataset = dataset
        self.multi_hot = multi_hot if multi_hot is not None and multi_hot.needed else None
        self.reader = make_reader(reader, dataset, dali_device)
        self.seed, self.shuffle, self.last_batch = seed, shuffle, last_batch
        self.eval_split = eval_split
        self._plans: dict[tuple[int, str], BatchPlan] = {}

    def _split(self, split: str) -> str:
        return self.eval_split if split == "eval" else split

    def plan(self, batch_size: int, split: str = "train") -> BatchPlan:
        name = self._split(split)
        key = (batch_size, name)
        if key not in self._plans:
            start, end = self.dataset.split(name)
            self._plans[key] = BatchPlan(
                start,
                end,
                self.dataset.block_rows,
                batch_size,
                shuffle=self.shuffle and name == "train",
                seed=self.seed,
                # held-out splits always fill their last batch by wrapping around; the
                # wrapped samples are masked out of the metrics (see split_rows)
                last_batch=self.last_batch if name == "train" else "pad",
                name=name,
            )
        return self._plans[key]

    def steps_per_epoch(self, batch_size: int, split: str = "train") -> int:
        plan = self.plan(batch_size, split)
        if plan.steps_per_epoch == 0 and self._split(split) == "train":
            raise ValueError(plan.too_small())
        return plan.steps_per_epoch

    def split_rows(self, split: str) -> int:
        """Rows in `split`: global positions at or past it in the last (wrapped) batch of a
        held-out split repeat earlier rows, and evaluation leaves them out."""
        start, end = self.dataset.split(self._split(split))
        return max(end - start, 0)

    def batch(self, step: int, batch_size: int, split: str = "train") -> Batch:
        return self.slice_batch(step, batch_size, split, 0, batch_size)

    def slice_batch(self, step: int, batch_size: int, split: str, lo: int, hi: int) -> Batch:
        """Samples [lo, hi) of global batch `step` (what one rank keeps), read alone."""
        plan = self.plan(batch_size, split)
        if plan.steps_per_epoch == 0 and self._split(split) == "train":
            raise ValueError(plan.too_small())
        if self._split(split) != "train" and step >= plan.steps_per_epoch:
            raise IndexError(
                f"split {plan.name!r} has {plan.steps_per_epoch} batches of {batch_size}; "
                f"asked for batch {step}"
            )
        batch = self.reader.read(plan, step, lo, hi)
        if self.multi_hot is not None:
            batch = Batch(batch.dense, self.multi_hot(batch.ids), batch.labels)
        return batch

    def id_counts(self, table_index: int) -> np.ndarray | None:
        """Train frequency of every id of table `table_index`, [num_embeddings] int64 (from
        the manifest's counts file; None when there is none, or for a dynamic table, whose
        counts file holds raw ids, not rows): warm-starts host caches."""
        m = self.dataset.manifest
        if m.features and m.features[table_index].get("dynamic"):
            return None
        stats = m.tables[table_index]
        path = self.dataset.path / stats.counts_file
        if not stats.counts_file or not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as f:
                ids, counts = f["ids"], f["counts"]
        except ValueError as e:
            if "allow_pickle" not in str(e):
                raise
            raise ValueError(
                f"{path}: refused: it holds a numpy object array (pickled Python objects), "
                "not integer ids and counts; nothing in it was run. Re-run hybridrec-preprocess"
            ) from None
        dense = np.zeros(stats.num_embeddings, dtype=np.int64)
        dense[ids] = counts
        return dense

    def split_ids(
        self, split: str, columns: Sequence[int], start: int, stop: int
    ) -> np.ndarray | None:
        """Id columns `columns` of rows [start, stop) of `split` (BatchSource.split_ids)."""
        a, b = self.dataset.split(self._split(split))
        lo, hi = a + start, min(a + stop, b)
        self.dataset.check_rows(lo, hi)
        return np.asarray(self.dataset.categorical[lo:hi][:, list(columns)], dtype=np.int64)

    def row_of(self, step: int, batch_size: int, split: str, sample: int) -> str | None:
        """Where sample `sample` of batch `step` of `split` is: "row R of dataset PATH"."""
        pos = 0
        for lo, hi in self.plan(batch_size, split).segments(step):
            if sample < pos + hi - lo:
                return f"row {lo + sample - pos} of dataset {self.dataset.path}"
            pos += hi - lo
        return None

    def dense_names(self) -> list[str] | None:
        """The manifest's names of the dense features (I1..I13 for Criteo), when it has them."""
        schema = self.dataset.manifest.schema or {}
        fields = schema.get("dense", {}).get("fields") if isinstance(schema, dict) else None
        return list(fields) if fields else None

    def close(self) -> None:
        self.reader.close()


# -- checking the model against the data -------------------------------------------------------


def check_model_matches(
    manifest: Manifest, model: ModelConfig, where: str, multi_hot: str = "none"
) -> None:
    """ValueError (naming the table) unless the model's tables fit the dataset exactly
    (multi-hot tables only with data.multi_hot=synthetic)."""
    cards = manifest.cardinalities
    rows = list(model.num_embeddings_per_feature)
    fix = f"model.num_embeddings_per_feature=[{','.join(map(str, cards))}]"
    dense = manifest.arrays["dense"].row_shape[0]
    if model.num_dense_features != dense:
        raise ValueError(
            f"dataset {where} has {dense} dense features but model.num_dense_features="
            f"{model.num_dense_features}"
        )
    if len(rows) != len(cards):
        raise ValueError(
            f"dataset {where} has {len(cards)} categorical tables but the model "
            f"({model.name}) has {len(rows)}; use a model with the dataset's tables: {fix}"
        )
    hot, jagged = model.hotness_list(), model.per_table("jagged")
    data_hot = manifest.hotness
    for t, (table, h) in enumerate(zip(manifest.tables, hot, strict=True)):
        f = manifest.features[t] if manifest.features else None
        if f is not None and (h != f["hotness"] or bool(jagged[t]) != f["jagged"]):
            raise ValueError(
                f"table {table.name}: the dataset {where} holds {f['hotness']} id column(s) "
                f"(jagged: {f['jagged']}) but the model has hotness {h}, jagged {jagged[t]}; "
                "use data=table, which takes them from the dataset"
            )
        if h != data_hot[t] and multi_hot != "synthetic":
            raise ValueError(
                f"table {table.name}: model.hotness is {h} but the dataset is one-hot "
                "(one id per sample and table); set model.hotness=1, or data.multi_hot="
                "synthetic to expand each id into a bag of that many (hybridrec.data.multihot)"
            )
        if rows[t] != table.num_embeddings:
            raise ValueError(
                f"table {table.name} ({table.field}): the dataset {where} has "
                f"{table.num_embeddings} ids but model.num_embeddings_per_feature[{t}]="
                f"{rows[t]} (model {model.name}); the tables must match the data: {fix}"
            )


# -- the criteo_sample cache -------------------------------------------------------------------


def sample_path(configured: str | None) -> Path:
    """The raw sample TSV: the config's data.path, else $HYBRIDREC_CRITEO_SAMPLE. The file is
    not part of the repository, and no other place is searched: a file named by either must
    exist (falling back to another one would train on other data than asked for)."""
    for key, candidate in (
        ("data.path", configured),
        (f"${SAMPLE_ENV}", os.environ.get(SAMPLE_ENV)),
    ):
        if candidate:
            p = Path(candidate).expanduser()
            if not p.is_file():
                raise ValueError(f"criteo_sample: {key}={p}: no such file")
            return p
    raise ValueError(
        f"data=criteo_sample needs the 200-row Criteo sample file (criteo_sample.tsv, not in "
        f"this repository): set data.path=<file> or ${SAMPLE_ENV}=<file>"
    )


def cache_root(configured: str | None) -> Path:
    root = configured or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hybridrec"
    return Path(root).expanduser()


def preprocessed_sample(raw: Path, cache: Path, options: dict) -> Path:
    """The preprocessed copy of `raw` under `cache`, built (once) if missing."""
    from hybridrec.data.preprocess import PreprocessOptions, preprocess

    opts = PreprocessOptions(**options)
    h = hashlib.sha256(raw.read_bytes())
    h.update(json.dumps([VERSION, opts.output_options()], sort_keys=True).encode())
    target = cache / f"{raw.stem}-{h.hexdigest()[:16]}"
    if (target / MANIFEST).is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache))
    try:
        log.info("preprocessing %s into %s", raw, target)
        preprocess([raw], tmp, opts, workers=1, progress=False)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MANIFEST).is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def dataset_dir(cfg: Config) -> Path:
    d = cfg.data
    if d.name in ("criteo", "table"):
        if not d.path:
            raise ValueError(
                f"data.name={d.name} needs data.path: a directory made by hybridrec-preprocess"
            )
        return Path(d.path).expanduser()
    if d.name == "criteo_sample":
        options = dataclasses.asdict(d.preprocess)
        return preprocessed_sample(sample_path(d.path), cache_root(d.cache_dir), options)
    raise ValueError(f"data.name={d.name!r} has no dataset directory")


def open_source(cfg: Config) -> BinarySource:
    """The BinarySource for data.name=criteo|criteo_sample, checked against the model."""
    path = dataset_dir(cfg)
    ds = open_dataset(path, cfg.data.verify)
    check_model_matches(ds.manifest, cfg.model, str(path), cfg.data.multi_hot)
    dali_device = "cpu"
    if cfg.data.reader == "dali" and cfg.data.dali_device != "cpu":
        import torch

        want_gpu = cfg.data.dali_device == "gpu" or (
            cfg.device in ("auto", "cuda") and torch.cuda.is_available()
        )
        dali_device = "gpu" if want_gpu else "cpu"
    log.info("data: %r, reader %s, loader %s", ds, cfg.data.reader, cfg.data.loader)
    source = BinarySource(
        ds,
        cfg.data.reader,
        cfg.seed,
        cfg.data.shuffle,
        cfg.data.last_batch,
        cfg.data.eval_split,
        dali_device,
        SyntheticMultiHot(cfg.model.num_embeddings_per_feature, cfg.model.hotness_list())
        if cfg.data.multi_hot == "synthetic"
        else None,
    )
    source.steps_per_epoch(cfg.train.batch_size, "train")  # too small a split: fail now
    if cfg.eval.batches != 0 and source.split_rows("eval") == 0:
        log.warning("eval split %r is empty: evaluation will report nothing", cfg.data.eval_split)
    return source
