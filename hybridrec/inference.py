"""A trained model for scoring, from a `hybridrec-export` file: plain PyTorch, no trainer.

    model = load_export("model.pt")              # the model config travels in the file
    p = model.predict(dense, ids)                # predictions [B]

`predict` gives what model.task (in the exported config) predicts: click probabilities
(sigmoid of the output) for binary, the raw output for regression (hybridrec.model.task).
A retrieval model loads as a RetrievalExport: `topk(dense, ids, k, exclude)` ranks the
catalogue the file holds (hybridrec-export --retrieval) for each row's user.

The model class the config names, its tables given the trainer's own storage on one process
(hybridrec.scoring: the single-process EmbeddingCollection with no optimizer, in evaluation
mode): the trainer's lookup, code path for code path (pooling, jagged bags, shared tables,
dynamic tables' maps), not a re-implementation of it. Inputs as everywhere in hybridrec: dense
[B, num_dense_features] float (log-transformed as the data pipeline does), ids [B, H] int64, H
= the sum of the features' hotness, each feature's ids in its columns (a list feature's padded
with -1 past its length). Move it with `.to(device)`; it is an ordinary module. `predict`
checks its inputs first (shapes, dtypes, finite dense values, each table's id range) and raises
PredictInputError, one line naming the table or feature, the value and its row; `forward` does
not check (it stays traceable: torch.export, torch.jit.trace).

`hybridrec.model.load_export` (and InferenceModel, PredictInputError) name this module's: it
lives above hybridrec.sparse, since the model layer never imports the storage
(docs/architecture.md, Layering).

Loading reads data only: the file's tensors, and its model config as settings (the fields
of ModelConfig, an architecture hybridrec builds). Nothing the file names is imported or
called unless the caller opts in: a `model._target_` (the user's class) is built only by
load_export(path, trust_import=True); a file holding anything else is refused.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from hybridrec.config import ARCHS, ModelConfig
from hybridrec.model.registry import MODELS, import_class, make_model
from hybridrec.model.retrieval import NO_ITEM, decode_keys, order_keys, top_keys
from hybridrec.model.task import task_of, task_outputs
from hybridrec.safeload import load_tensors
from hybridrec.scoring import attach_scoring, export_views, load_rows
from hybridrec.sparse.api import EmbeddingModule
from hybridrec.types import TASKS, KeyedIds, hot_offsets

MODEL_CONFIG_KEY = "model_config"  # JSON of the model config, in an exported file
# a retrieval export's catalogue (hybridrec-export --retrieval): item ids [N], vectors [N, D]
ITEM_IDS, ITEM_VECTORS = "retrieval.item_ids", "retrieval.item_vectors"


class PredictInputError(ValueError):
    """Inputs `predict` cannot score: the message names the table or feature and the row."""


class Scorer(nn.Module):
    """What every exported model shares: `predict` (checked inputs, eval mode, the task's
    prediction) over forward(dense [B, num_dense], ids [B, H]) -> raw outputs [B] fp32; ids
    hold the dataset's features (`tables`) in order."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.task = task_of(cfg.task)
        self.num_dense = cfg.num_dense_features
        self.tables = list(cfg.tables())
        self.offsets = hot_offsets(self.tables)

    @torch.no_grad()
    def predict(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Predictions [B] in eval mode, inputs checked: click probabilities (sigmoid of the
        logits) for model.task=binary, the raw output for regression."""
        self.check_inputs(dense, ids)
        self.eval()
        return self.task.predict(self(dense, ids))

    def check_inputs(self, dense: torch.Tensor, ids: torch.Tensor) -> None:
        """Raise PredictInputError unless dense is [B, num_dense_features] of finite floats
        and ids [B, H] int64 or int32, each inside its table (a host sync: the checks read
        values)."""
        nd, h = self.num_dense, self.offsets[-1]
        if not isinstance(dense, torch.Tensor) or not isinstance(ids, torch.Tensor):
            raise PredictInputError(
                f"predict(dense, ids) takes two tensors, got {type(dense).__name__} and "
                f"{type(ids).__name__}"
            )
        if dense.dim() != 2 or dense.shape[1] != nd or not dense.is_floating_point():
            raise PredictInputError(
                f"dense must be a float tensor [batch, {nd}] (model.num_dense_features), got "
                f"{dense.dtype} {list(dense.shape)}"
            )
        if ids.dim() != 2 or ids.shape[1] != h or ids.dtype not in (torch.int64, torch.int32):
            raise PredictInputError(
                f"ids must be an int64 (or int32) tensor [batch, {h}] (one column per id of the "
                f"{len(self.tables)} tables), got {ids.dtype} {list(ids.shape)}"
            )
        if dense.shape[0] != ids.shape[0]:
            raise PredictInputError(
                f"dense has {dense.shape[0]} rows but ids has {ids.shape[0]}; one row per sample"
            )
        bad = ~torch.isfinite(dense)
        if bool(bad.any()):
            row, col = (int(x) for x in bad.nonzero()[0])
            raise PredictInputError(
                f"dense feature {col}: {float(dense[row, col])} at row {row} is not finite "
                "(NaN or inf); give every dense feature a number"
            )
        for i, t in enumerate(self.tables):
            cols = ids[:, self.offsets[i] : self.offsets[i + 1]]
            if t.dynamic is not None:  # raw ids: any id >= 0
                out = cols < (-1 if t.jagged else 0)
                if bool(out.any()):
                    row, col = (int(x) for x in out.nonzero()[0])
                    raise PredictInputError(
                        f"table {t.name!r} (feature {i}): id {int(cols[row, col])} at row {row} "
                        f"is negative; a dynamic table takes raw ids >= 0"
                        f"{', or -1 for no id' if t.jagged else ''}"
                    )
                continue
            out = (cols < (-1 if t.jagged else 0)) | (cols >= t.num_rows)
            if bool(out.any()):
                row, col = (int(x) for x in out.nonzero()[0])
                raise PredictInputError(
                    f"table {t.name!r} (feature {i}): id {int(cols[row, col])} at row {row} is "
                    f"outside its {t.num_rows} rows (valid ids: 0..{t.num_rows - 1}"
                    f"{', or -1 for no id' if t.jagged else ''})"
                )


class InferenceModel(Scorer):
    """The config's model (any model.arch, or model._target_) for scoring: the class built
    from the config, its EmbeddingTables given the trainer's storage on one process
    (hybridrec.scoring.attach_scoring). `net` is the module; `storages` its embedding modules
    (ScoringCollections), in module order."""

    def __init__(self, cfg: ModelConfig, cls: type[nn.Module]) -> None:
        super().__init__(cfg)
        self.net = make_model(cfg, cls)
        attach_scoring(self.net)
        self.names = tuple(t.name for t in self.tables)
        self.hotness = tuple(t.hotness for t in self.tables)

    @property
    def storages(self) -> list[EmbeddingModule]:
        return [m for m in self.net.modules() if isinstance(m, EmbeddingModule)]

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        keyed = KeyedIds(ids.long(), self.names, self.hotness)  # (int32 ids: the lookups' int64)
        return task_outputs(self.net(dense, keyed))

    def expected(self) -> dict[str, torch.Tensor]:
        """The export's keys this model reads, to the tensors they load into: each table's
        rows (`embeddings.<table>.weight`), a dynamic table's map (`embeddings.<table>.slot_id`)
        and the dense state (`dense.<module path>`)."""
        out = export_views(self.storages)
        skip = tuple(f"{n}." for n, m in self.net.named_modules() if isinstance(m, EmbeddingModule))
        for k, v in self.net.state_dict(keep_vars=True).items():
            if not k.startswith(skip):
                out[f"dense.{k}"] = v
        return out


class RetrievalExport(InferenceModel):
    """A retrieval model (model.task=retrieval) for serving: its towers, and the catalogue's
    item vectors when the file has them (`hybridrec-export --retrieval`): `item_ids` [N]
    (the item feature's ids, ascending) and `item_vectors` [N, D], what an ANN index holds.

    `query(dense, ids)` -> user vectors [B, D]; `topk(dense, ids, k, exclude)` -> (item ids
    [B, k], scores [B, k]), every item scored, higher first, equal scores by lower item id
    (the trainer's evaluation order: hybridrec.model.retrieval), -1 past the items left;
    forward (and predict) score each row's own item: <query, candidate> [B]."""

    item_ids: torch.Tensor | None = None
    item_vectors: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, cls: type[nn.Module]) -> None:
        super().__init__(cfg, cls)
        self.item_feature = self.net.item_feature

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        keyed = KeyedIds(ids.long(), self.names, self.hotness)
        items = keyed.select([self.item_feature], [1]).view(-1)
        return (self.net.query(dense, keyed) * self.net.candidates(items)).sum(1).float()

    @torch.no_grad()
    def query(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """User vectors [B, D] of rows dense [B, F], ids [B, H] (inputs checked; only the
        user tower's features are read, the others may hold any valid id)."""
        self.check_inputs(dense, ids)
        self.eval()
        return self.net.query(dense, KeyedIds(ids.long(), self.names, self.hotness)).float()

    @torch.no_grad()
    def candidates(self, item_ids: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
        """Item vectors [n, D] of item ids [n] (the item tower), in chunks of `chunk`."""
        self.eval()
        parts = [
            self.net.candidates(item_ids[a : a + chunk].long())
            for a in range(0, len(item_ids), chunk)
        ]
        return torch.cat(parts).float() if parts else torch.empty(0)

    @torch.no_grad()
    def topk(
        self,
        dense: torch.Tensor,
        ids: torch.Tensor,
        k: int,
        exclude: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best items of the catalogue for each row's user (class docstring);
        `exclude[i]`: item ids row i must not get (the items its user has met)."""
        if self.item_ids is None or self.item_vectors is None:
            raise ValueError(
                "this export has no item vectors: write it with hybridrec-export --retrieval"
            )
        q = self.query(dense, ids)
        scores = q @ self.item_vectors.T  # [B, N]
        keys = order_keys(scores, self.item_ids.unsqueeze(0))
        if exclude is not None:
            where = {int(i): n for n, i in enumerate(self.item_ids.tolist())}
            for row, items in enumerate(exclude):
                cols = [where[int(i)] for i in items if int(i) in where]
                keys[row, cols] = NO_ITEM
        return decode_keys(top_keys(keys, k))


def model_config(path: Path, text: object, trust_import: bool = False) -> ModelConfig:
    """The model config an export carries: a JSON object of ModelConfig fields with a
    registered `arch`. Anything else (an unknown key or architecture) is refused naming the
    file; so is a `_target_` (a class to import) unless `trust_import`."""
    try:
        d = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError:
        d = None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: model_config is not a JSON object of model settings; refused")
    if d.get("_target_") is not None and not trust_import:
        raise ValueError(
            f"{path}: model_config '_target_'={d['_target_']!r} is code to import, not model "
            "settings; refused (load_export(path, trust_import=True) imports it: only for a "
            "file you trust)"
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


def load_export(
    path: str | Path, cfg: ModelConfig | None = None, trust_import: bool = False
) -> Scorer:
    """The model in a hybridrec-export file (an InferenceModel). `cfg`: the model config, needed
    only for files written before exports carried it; shapes are checked either way.
    `trust_import`: build a `model._target_` class, which imports it (runs its module's code);
    refused otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such exported model (write one with hybridrec-export)")
    state = load_tensors(path)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not an exported state dict")
    if cfg is None:
        if MODEL_CONFIG_KEY not in state:
            raise ValueError(
                f"{path} carries no model config (exported by an older hybridrec); pass the "
                "model config: load_export(path, cfg.model)"
            )
        cfg = model_config(path, state[MODEL_CONFIG_KEY], trust_import)
    elif cfg._target_ is not None and not trust_import:
        raise ValueError(
            f"model._target_={cfg._target_}: building it imports it; pass trust_import=True"
        )
    cls = import_class(cfg._target_) if cfg._target_ else MODELS[cfg.arch]
    model = (RetrievalExport if cfg.task == "retrieval" else InferenceModel)(cfg, cls)
    params = model.expected()
    weights = {k: v for k, v in state.items() if k.startswith(("embeddings.", "dense."))}
    expected = {k: list(v.shape) for k, v in params.items()}
    diffs = [
        f"{k}: file {list(weights[k].shape) if k in weights else 'missing'}, model {shape}"
        for k, shape in expected.items()
        if k not in weights or list(weights[k].shape) != shape
    ]
    if diffs:
        raise ValueError(f"{path} does not fit model {cfg.name}:\n  " + "\n  ".join(diffs))
    unexpected = sorted(set(weights) - set(params))
    if unexpected:
        raise ValueError(f"{path} does not fit model {cfg.name}: unexpected {unexpected}")
    with torch.no_grad():
        for k, v in params.items():
            if k.startswith("dense."):
                v.copy_(weights[k])
    load_rows(weights, model.storages)  # every shard of the storage from the file's tables
    if isinstance(model, RetrievalExport) and ITEM_IDS in state:
        model.item_ids = state[ITEM_IDS].long()
        model.item_vectors = state[ITEM_VECTORS].float()
    return model.eval()
