"""Models by config: a built-in one by name (`model.arch`), or the user's by import path
(`model._target_=my_pkg.MyModel`, Hydra's convention), with keyword arguments `model.args`.
`build_model(m)` is the one way a config becomes a model (no rows yet: hybridrec.parallelize,
or hybridrec.scoring for scoring, gives them); every model declares its tables with
EmbeddingTables, so every model is sharded the same way.

The contract of a model class (docs/library.md, "Models by config"):
- `__init__(**model.args)`; a parameter named `features` also receives the dataset's sparse
  features (a tuple of TableConfig: name, table_name, num_rows, dim, hotness, pooling,
  jagged), `num_dense_features` the number of dense inputs, `task` model.task, `config` the
  whole model config (the built-in DLRM reads its keys from it).
- It declares `EmbeddingTables` whose features are named as the dataset's, with the same ids
  per sample and list flag, and tables at least as long as the dataset's.
- `forward(dense [B, num_dense_features] float, ids: KeyedIds) -> outputs [B]`; for
  model.task=retrieval, the retrieval contract instead (hybridrec.model.retrieval: query,
  candidates, user_feature, item_feature; forward(dense, ids, negatives) -> (query,
  candidates)), checked here.
- Its loss is model.task's (hybridrec.model.task), or its own `loss(outputs, batch)`; a class
  attribute `task` ("binary", "regression" or "retrieval") states the one it needs, refused
  when the config's differs.
Every mismatch is one line naming the model, feature and what to do.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence

from torch import nn

from hybridrec.config import ModelConfig
from hybridrec.model.dlrm import DLRM
from hybridrec.model.retrieval import check_retrieval_model
from hybridrec.model.tables import declared_tables
from hybridrec.model.zoo import TwoTower, WideDeep
from hybridrec.types import TableConfig

MODELS: dict[str, type[nn.Module]] = {
    "dlrm": DLRM,
    "dcnv2": DLRM,  # the same class: model.arch picks the interaction
    "two_tower": TwoTower,
    "wide_deep": WideDeep,
}
# filled in by name, not from model.args
PROVIDED = ("features", "num_dense_features", "task", "config", "label_mean")


def model_name(m: ModelConfig) -> str:
    """How messages name the model: its import path, or model.arch."""
    return f"model._target_={m._target_}" if m._target_ else f"model.arch={m.arch}"


def import_class(path: str) -> type[nn.Module]:
    """The class at import path "pkg.module.Class" (imports it: call only on a path the user
    gave to run). ValueError (one line) when it does not import or is not an nn.Module."""
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"model._target_={path!r} must be an import path: pkg.module.Class")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"model._target_={path} does not import: {type(e).__name__}: {e} (is its package "
            "on PYTHONPATH?)"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"model._target_={path} is not an nn.Module class")
    return cls


def model_class(m: ModelConfig) -> type[nn.Module]:
    """The class a model config names (importing a `_target_`)."""
    if m._target_:
        return import_class(m._target_)
    if m.arch not in MODELS:
        raise ValueError(f"model.arch={m.arch!r} is not one of: {', '.join(MODELS)}")
    return MODELS[m.arch]


def build_model(m: ModelConfig) -> nn.Module:
    """The model `m` names, its declared features checked against the data (no rows yet)."""
    return make_model(m, model_class(m))


def make_model(m: ModelConfig, cls: type[nn.Module]) -> nn.Module:
    """An instance of `cls` for `m` (no embedding rows yet: hybridrec.parallelize, or
    hybridrec.scoring for scoring, gives them), its features checked against the data."""
    params = inspect.signature(cls).parameters
    given = [k for k in m.args if k in PROVIDED]
    if given:
        raise ValueError(
            f"model.args.{given[0]}: {model_name(m)} gets {given[0]} from the dataset; drop it"
        )
    provided = {
        "features": m.tables(),
        "num_dense_features": m.num_dense_features,
        "task": m.task,
        "config": m,
        "label_mean": m.label_mean,
    }
    kwargs = {k: v for k, v in provided.items() if k in params}
    kwargs.update(m.args)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"{model_name(m)}: model.args do not fit its __init__: {e}") from None
    try:
        model = cls(**kwargs)
    except ValueError as e:  # the class's own checks (EmbeddingTables, widths): name the model
        raise ValueError(f"{model_name(m)}: {e}") from None
    stated = getattr(cls, "task", None)
    if isinstance(stated, str) and stated != m.task:
        raise ValueError(
            f"{model_name(m)} is a {stated} model but the data's task is model.task={m.task}"
        )
    check_features(model, m.tables(), model_name(m))
    if m.task == "retrieval":
        check_retrieval_model(model, [f.name for f in m.tables()], model_name(m))
    return model


def check_features(model: nn.Module, data: Sequence[TableConfig], name: str) -> None:
    """Every declared feature is a dataset feature with the same ids per sample and list flag,
    and its table holds the dataset table's ids; ValueError (one line) otherwise."""
    declared = declared_tables(model)
    if not declared:
        raise ValueError(
            f"{name} declares no EmbeddingTables: declare its tables with "
            "hybridrec.EmbeddingTables (docs/library.md)"
        )
    by_name = {f.name: f for f in data}
    for path, tables in declared:
        where = f"{name} ({path or 'the model'})"
        for f in tables.features:
            d = by_name.get(f.name)
            if d is None:
                raise ValueError(
                    f"{where}: feature {f.name!r} is not in the dataset; its features are "
                    f"{list(by_name)} (name the model's features as the dataset's)"
                )
            if f.hotness != d.hotness or f.jagged != d.jagged:
                raise ValueError(
                    f"{where}: feature {f.name!r} reads {f.hotness} ids per sample"
                    f"{' (a list)' if f.jagged else ''}, the dataset has {d.hotness}"
                    f"{' (a list)' if d.jagged else ''}; declare Feature({f.name!r}, ..., "
                    f"hotness={d.hotness}, jagged={d.jagged})"
                )
            if f.num_rows < d.num_rows and f.dynamic is None:  # a dynamic table: raw ids
                raise ValueError(
                    f"{where}: table {f.table_name!r} has {f.num_rows} rows, but the dataset's "
                    f"feature {f.name!r} has ids up to {d.num_rows - 1}; give it >= "
                    f"{d.num_rows} rows"
                )


def check_model_config(m: ModelConfig) -> None:
    """Config-time check of a model class's config: it imports, takes model.args, declares
    the dataset's features (builds the declaration, no rows)."""
    make_model(m, model_class(m))
