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

A config read from a file (an export's `model_config`: `model_config`) is settings only, and
a `_target_` in it is never imported: the class is the one its user names (`named_class`),
compared with it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from hybridrec.config import ARCHS, ModelConfig
from hybridrec.model.dlrm import DLRM
from hybridrec.model.retrieval import check_retrieval_model
from hybridrec.model.sequential import HSTUModel, SASRecModel
from hybridrec.model.tables import declared_tables
from hybridrec.model.zoo import TwoTower, WideDeep
from hybridrec.types import TASKS, TableConfig

MODELS: dict[str, type[nn.Module]] = {
    "dlrm": DLRM,
    "dcnv2": DLRM,  # the same class: model.arch picks the interaction
    "two_tower": TwoTower,
    "wide_deep": WideDeep,
    "sasrec": SASRecModel,
    "hstu": HSTUModel,
}
# filled in by name, not from model.args
PROVIDED = ("features", "num_dense_features", "task", "config")


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


def model_config(path: Path, text: object, allow_target: bool = False) -> ModelConfig:
    """The model config an export carries: a JSON object of ModelConfig fields with a
    registered `arch`. Anything else (an unknown key or architecture) is refused naming the
    file; so is a `_target_` (a class to import) unless `allow_target`: the caller then
    compares it with the class its user named (`named_class`), never importing it."""
    try:
        d = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError:
        d = None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: model_config is not a JSON object of model settings; refused")
    if d.get("_target_") is not None and not allow_target:
        raise ValueError(
            f"{path}: model_config '_target_'={d['_target_']!r} is code to import, not model "
            "settings; refused: nothing an export names is imported (if you trained it, name "
            "your class: load_export(path, model=YourClass) or model='pkg.Class')"
        )
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
        raise ValueError(
            f"{path}: model_config keys {unknown} are not model settings; refused (an export "
            "carries settings, never code to build)"
        )
    arch = d.get("arch", ModelConfig.arch)
    if arch not in ARCHS:
        raise ValueError(
            f"{path}: model_config arch {arch!r} is not one of {', '.join(ARCHS)}; refused"
        )
    task = d.get("task", ModelConfig.task)  # exports older than model.task are binary
    if task not in TASKS:
        raise ValueError(
            f"{path}: model_config task {task!r} is not one of {', '.join(TASKS)}; refused"
        )
    return ModelConfig(**d)


def class_name(model: type | str) -> str:
    """How a named class is compared with a file's `_target_`: its import path."""
    return model if isinstance(model, str) else f"{model.__module__}.{model.__qualname__}"


def named_class(
    where: object, cfg: ModelConfig, model: type[nn.Module] | str | None
) -> type[nn.Module]:
    """The class to build for `cfg` (the config `where` holds), given the class the caller
    named: `model` (a class, or its import path, which is imported: the caller named it).
    A built-in architecture needs none; a `_target_` needs one, equal to it (a class also
    matches when the target's module, already imported, holds it); ValueError (one line
    naming both) otherwise. The file's `_target_` itself is never imported."""
    target = cfg._target_
    if model is None:
        if target is not None:
            raise ValueError(
                f"{where} was trained with model._target_={target}, a class of your own; "
                "nothing a file names is imported: name the class, load_export(path, "
                "model=YourClass) or model='pkg.Class'"
            )
        return MODELS[cfg.arch]
    if not isinstance(model, str) and not (
        isinstance(model, type) and issubclass(model, nn.Module)
    ):
        raise ValueError(
            f"model= takes an nn.Module class or its import path, got {type(model).__name__}"
        )
    name = class_name(model)
    if target is None:
        raise ValueError(
            f"{where} holds the built-in model.arch={cfg.arch}, but model={name} was named; "
            "drop model= (a built-in model needs no class)"
        )
    module, _, attr = target.rpartition(".")
    loaded = getattr(sys.modules.get(module), attr, None) if module in sys.modules else None
    if name != target and (isinstance(model, str) or loaded is not model):
        raise ValueError(
            f"{where} was trained with model._target_={target}, but model={name} was named; "
            "name the class it was trained with"
        )
    return import_class(model) if isinstance(model, str) else model
