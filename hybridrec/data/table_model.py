"""`data=table`: the model's table keys come from the dataset's manifest, before validation.

`fill_model(raw)` runs inside hybridrec.config.validate on the composed config, so every rank
(each composes and validates the same command line) and every checkpoint (which compares model
configs on resume) sees the filled values. conf/model/table.yaml (selected by
conf/data/table.yaml) leaves these keys null, meaning "from the dataset":

    task, num_dense_features, feature_names, table_names, num_embeddings_per_feature,
    embedding_dims, embedding_dim, hotness, pooling, jagged, mean_ids;
    bottom_mlp null -> [64, first table's width];
    label_mean null -> the train split's mean label, for model.task=regression (two_tower's
    global bias starts there); the user may set it

Per sparse feature, in spec order: its name, the table it looks up (repeated for features
sharing one), that table's rows and width; a feature named like its table has it alone.
`model.dynamic` gets each `encoding: dynamic` table's policy from the spec (its rows are the
spec's capacity); policy keys the user set (`+model.dynamic.user.evict=lru`) override the
spec's, and naming a table the dataset keeps fixed is refused (its ids are not raw ids).

A key the user set (not null) must equal the dataset's value: else one line naming the key and
the dataset's value; `model.task=retrieval` fits any dataset (its rows are positive
(user, item) pairs, the label is not read). `data.spec`, when given, must be the spec the
data was preprocessed with (its fingerprint). Filling an already filled config changes
nothing (validate is idempotent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from hybridrec.data.dataset import open_dataset
from hybridrec.data.manifest import Manifest
from hybridrec.data.spec import load_spec

PER_TABLE = ("hotness", "pooling", "jagged")


def dataset_model(manifest: Manifest) -> dict[str, Any]:
    """The model keys a table dataset fixes (see the module docstring)."""
    f = manifest.features
    widths = [int(x["width"]) for x in f]
    return {
        "task": manifest.schema["labels"]["task"],
        "num_dense_features": int(manifest.arrays["dense"].row_shape[0]),
        "feature_names": [x["name"] for x in f],
        "table_names": [x["table"] for x in f],
        "num_embeddings_per_feature": [int(x["num_embeddings"]) for x in f],
        "embedding_dims": widths,
        "embedding_dim": widths[0],
        "hotness": [int(x["hotness"]) for x in f],
        "pooling": [x["pooling"] for x in f],
        "jagged": [bool(x["jagged"]) for x in f],
        "mean_ids": [_mean_ids(x) for x in f],
    }


def _mean_ids(feature: dict[str, Any]) -> float:
    """Ids per bag on average: a list's mean length, at most max_len (the recorded mean is
    of the lists before truncation)."""
    if not feature["jagged"]:
        return float(feature["hotness"])
    return min(float(feature["length"]["mean"]), float(feature["hotness"]))


def dataset_dynamic(manifest: Manifest) -> dict[str, dict[str, Any]]:
    """{table: policy} of the dataset's dynamic tables (manifest features with `dynamic`)."""
    return {x["table"]: dict(x["dynamic"]) for x in manifest.features if x.get("dynamic")}


def _dynamic(path: Path, manifest: Manifest, given: Any) -> dict[str, dict[str, Any]] | None:
    """The dataset's dynamic policies with the user's keys over them (see the module docstring)."""
    want = dataset_dynamic(manifest)
    given = OmegaConf.to_container(given) if OmegaConf.is_config(given) else (given or {})
    for table, policy in given.items():
        if table not in want:
            fixed = [x["table"] for x in manifest.features]
            what = "is not dynamic" if table in fixed else "is not a table"
            raise ValueError(
                f"model.dynamic.{table}: {table!r} {what} in the dataset {path} (its dynamic "
                f"tables: {', '.join(want) or 'none'}); give the column encoding: dynamic in the "
                "spec and preprocess again"
            )
        if isinstance(policy, dict):
            want[table].update(policy)
        else:
            want[table] = policy  # not a mapping: config.checks names the key
    return want or None


def train_label_mean(path: Path, chunk: int = 1 << 22) -> float | None:
    """The mean label of the dataset's train split (float64 sums over chunks); None without
    train rows."""
    ds = open_dataset(path)
    a, b = ds.split("train") if "train" in ds.manifest.splits else (0, 0)
    if b <= a:
        return None
    total = sum(float(np.sum(ds.labels[i : min(i + chunk, b)], dtype=np.float64))
                for i in range(a, b, chunk))  # fmt: skip
    return total / (b - a)


def _same(key: str, given: Any, want: Any) -> bool:
    if key in PER_TABLE and not isinstance(given, list):
        given = [given] * len(want)
    return given == want


def open_manifest(data: DictConfig) -> tuple[Path, Manifest]:
    """The table dataset `data.path` names, checked against `data.spec` when given."""
    if OmegaConf.is_missing(data, "path") or not data.get("path"):
        raise ValueError(
            "data=table needs data.path: a directory made by hybridrec-preprocess --spec "
            "(docs/data-spec.md)"
        )
    path = Path(str(data.path)).expanduser()
    m = Manifest.load(path)
    if m.spec is None:
        raise ValueError(
            f"data.path={path} holds Criteo data, not a table made from a dataset spec; use "
            "data=criteo for it, or preprocess your table with hybridrec-preprocess --spec"
        )
    spec_file = data.get("spec")
    if spec_file:
        want = load_spec(spec_file).fingerprint()
        have = m.options.get("spec_fingerprint")
        if want != have:
            raise ValueError(
                f"data.spec={spec_file} is not the spec {path} was preprocessed with (spec "
                f"fingerprint {want}, the dataset's {have}); re-run hybridrec-preprocess --spec "
                f"{spec_file} --input ... --output {path}, or point data.path at its output"
            )
    return path, m


def fill_model(raw: DictConfig) -> DictConfig:
    """`raw` with the model keys the table dataset fixes filled in (a copy); see above."""
    raw = OmegaConf.create(OmegaConf.to_container(raw, resolve=False))
    path, manifest = open_manifest(raw.data)
    model = raw.get("model") or OmegaConf.create({})
    for key, want in dataset_model(manifest).items():
        given = model.get(key)
        if given is None:
            model[key] = want
            continue
        given = OmegaConf.to_container(given) if OmegaConf.is_config(given) else given
        if key == "task" and given == "retrieval":  # any table: every row is a positive pair
            continue
        if not _same(key, given, want):
            raise ValueError(
                f"model.{key}={given} contradicts the dataset {path}: it has {want}; leave "
                f"model.{key} unset with data=table (model=table takes it from the dataset)"
            )
    model["dynamic"] = _dynamic(path, manifest, model.get("dynamic"))
    if model.get("task") == "regression" and model.get("label_mean") is None:
        model["label_mean"] = train_label_mean(path)
    if model.get("bottom_mlp") is None:
        model["bottom_mlp"] = [64, int(model["embedding_dims"][0])]
    raw["model"] = model
    return raw
