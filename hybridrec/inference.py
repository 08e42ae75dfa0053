"""A trained model for scoring, from a `hybridrec-export` file: plain PyTorch, no trainer.

    model = load_export("model.pt")              # the model config travels in the file
    p = model.predict(dense, ids)                # predictions [B]

`predict` gives what model.task (in the exported config) predicts: click probabilities
(sigmoid of the output) for binary, the raw output for regression (hybridrec.model.task).
`topk(dense, ids, k, exclude)` ranks a catalogue for each row: a ranking model scores every
item through its own forward (the item feature varied, the row's other features fixed), a
retrieval model (a RetrievalExport) ranks the item vectors the file holds
(hybridrec-export --retrieval); both in the trainer's evaluation order (hybridrec.serving).
A next-item model (a NextItemExport) takes users' histories: `topk(histories, k)`
(hybridrec.next_item_serving).

The model class the config names, its tables given the trainer's own storage on one process
(hybridrec.scoring: the single-process EmbeddingCollection with no optimizer, in evaluation
mode): the trainer's lookup, code path for code path (pooling, jagged bags, shared tables,
dynamic tables' maps), not a re-implementation of it. Inputs as everywhere in hybridrec: dense
[B, num_dense_features] float (transformed as the data pipeline stored them), ids [B, H] int64,
H = the sum of the features' hotness, each feature's ids in its columns (a list feature's
padded with -1 past its length). With `raw=True`, `predict`, `query` and `topk` take the raw
dense values instead and apply the dataset's transforms the export recorded (log1p,
standardize with the train statistics: hybridrec.serving). Move it with `.to(device)`; it is
an ordinary module. `predict` checks its inputs first (shapes, dtypes, finite dense values,
each table's id range) and raises PredictInputError, one line naming the table or feature,
the value and its row; `forward` does not check (it stays traceable: torch.export,
torch.jit.trace).

`hybridrec.model.load_export` (and InferenceModel, PredictInputError) name this module's: it
lives above hybridrec.sparse, since the model layer never imports the storage
(docs/architecture.md, Layering).

Loading reads data only: the file's tensors, and its model config as settings (the fields
of ModelConfig, an architecture hybridrec builds). Nothing the file names is ever imported or
called: a model of the user's own class (`model._target_`) loads only when the caller names
the class, `load_export(path, model=MyModel)` or its import path `model="pkg.Class"`, and
the file's `_target_` is compared with it (a mismatch is refused naming both); a file holding
anything else is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from hybridrec.config import ModelConfig
from hybridrec.model.registry import MODELS, import_class, make_model, model_config, named_class
from hybridrec.model.retrieval import NO_ITEM
from hybridrec.model.tables import declared_tables
from hybridrec.model.task import task_of, task_outputs
from hybridrec.next_item_serving import NextItemServing, check_catalogue
from hybridrec.safeload import load_tensors
from hybridrec.scoring import attach_scoring, export_views, load_rows
from hybridrec.serving import (
    PAIRS_PER_BLOCK,
    SCORES_PER_BLOCK,
    TRAINED_PREFIX,
    TRANSFORMS_KEY,
    DenseTransforms,
    PredictInputError,
    catalogue,
    check_k,
    check_untrained,
    decode,
    excluded_positions,
    item_index,
    rank,
    untrained_error,
    untrained_rows,
)
from hybridrec.sparse.api import EmbeddingModule
from hybridrec.types import KeyedIds, hot_offsets

MODEL_CONFIG_KEY = "model_config"  # JSON of the model config, in an exported file
# a retrieval export's catalogue (hybridrec-export --retrieval): item ids [N], vectors [N, D]
ITEM_IDS, ITEM_VECTORS = "retrieval.item_ids", "retrieval.item_vectors"


__all__ = [
    "InferenceModel",
    "NextItemExport",
    "PredictInputError",
    "RetrievalExport",
    "Scorer",
    "load_export",
    "model_config",
]


class Scorer(nn.Module):
    """What every exported model shares: `predict` (checked inputs, eval mode, the task's
    prediction) over forward(dense [B, num_dense], ids [B, H]) -> raw outputs [B] fp32; ids
    hold the dataset's features (`tables`) in order. What the export recorded of its dataset
    (hybridrec.serving): `dense_transforms` (None: not recorded) and `trained` (feature ->
    bool [rows]: the rows its train split holds)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.task = task_of(cfg.task)
        self.num_dense = cfg.num_dense_features
        self.tables = list(cfg.tables())
        self.offsets = hot_offsets(self.tables)
        self.dense_transforms: DenseTransforms | None = None
        self.trained: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def predict(self, dense: torch.Tensor, ids: torch.Tensor, raw: bool = False) -> torch.Tensor:
        """Predictions [B] in eval mode, inputs checked: click probabilities (sigmoid of the
        logits) for model.task=binary, the raw output for regression. `raw`: dense holds raw
        values (`dense_inputs`)."""
        dense = self.dense_inputs(dense, raw)
        self.check_inputs(dense, ids)
        self.eval()
        return self.task.predict(self(dense, ids))

    def dense_inputs(self, dense: torch.Tensor, raw: bool) -> torch.Tensor:
        """`dense` as the model takes it: unchanged, or with `raw` the dataset's transforms
        (recorded in the export) applied to raw values [B, F] (NaN: a missing value)."""
        if not raw:
            return dense
        if self.dense_transforms is None:
            raise PredictInputError(
                "raw=True: this export does not record its dataset's dense transforms (written "
                "without its dataset, or by an older hybridrec): write it again with "
                "hybridrec-export --data DIR, or pass dense values as the dataset stores them"
            )
        return self.dense_transforms.apply(dense)

    def has_row(self, i: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Feature i's test of which ids have a trained row (ids >= 0 -> bool, same shape),
        from the export's record (any feature sharing its table counts); None when the
        export cannot tell."""
        f = self.tables[i]
        masks = [
            self.trained[g.name]
            for g in self.tables
            if g.table_name == f.table_name and g.name in self.trained
        ]
        if not masks:
            return None
        mask = torch.stack(masks).any(0)
        return lambda ids: mask[ids.clamp_max(len(mask) - 1)] & (ids < len(mask))

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

    def has_row(self, i: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Scorer.has_row; a dynamic table's ids have a row when its map holds them (every
        table serving the feature: the export's slot ids), whatever the record says."""
        held = self._held_ids(i)
        if not held:
            return super().has_row(i)
        return lambda ids: torch.stack([torch.isin(ids, h) for h in held]).all(0)

    def _held_ids(self, i: int) -> list[torch.Tensor]:
        """The raw ids each dynamic table serving feature i holds a row for (its map; the
        model declares which tables are dynamic); [] when none is."""
        views = export_views(self.storages)
        slots = [
            views[f"embeddings.{q.table_name}.slot_id"].cpu()
            for path, t in declared_tables(self.net)
            for g, q in zip(t.features, t.qualified(path), strict=True)
            if g.name == self.tables[i].name and q.dynamic is not None
        ]
        return [s[s >= 0] for s in slots]

    @torch.no_grad()
    def topk(
        self,
        dense: torch.Tensor,
        ids: torch.Tensor,
        k: int,
        exclude: Sequence[Sequence[int]] | None = None,
        *,
        item_feature: str | None = None,
        items: Sequence[int] | torch.Tensor | None = None,
        raw: bool = False,
        untrained: str = "refuse",
        batch: int = PAIRS_PER_BLOCK,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best items for each row: (item ids [B, k], scores [B, k]), every catalogue
        item scored by the model's own forward with row i's features fixed and its item
        feature set to the item; scores are forward's raw outputs (logits for binary, whose
        order is the probabilities'), higher first, equal scores by lower item id (the
        retrieval export's order), -1 and -inf past the items left.

        `item_feature`: the feature whose ids are the items, one id per sample (default: the
        model's `item_feature`, as two_tower has); its column in `ids` may hold any valid id.
        `items`: the catalogue (item ids); default every id of the item feature the export
        records as trained (a dynamic table: every id its map holds). `exclude[i]`: item
        ids row i must not get. `raw`: dense holds raw values. `untrained`: a row holding an
        id of another feature without a trained row (a user training never saw, a null no
        train row had) is refused ("refuse", PredictInputError naming it), given an empty
        list ("empty": -1 and -inf), or scored as it is ("score"); with "empty" an explicit
        catalogue's untrained items are left out, with "refuse" refused. `batch`: (row,
        item) pairs per forward."""
        k, untrained = check_k(k), check_untrained(untrained)
        i = item_index(self.tables, item_feature or getattr(self.net, "item_feature", None))
        dense = self.dense_inputs(dense, raw)
        self.check_inputs(dense, ids)
        self.eval()
        held = self._held_ids(i)
        items = catalogue(self.tables[i], items, untrained, self.has_row(i), *held[:1])
        off = excluded_positions(exclude, ids.shape[0], items)
        skip = torch.zeros(ids.shape[0], dtype=torch.bool)
        if untrained != "score":
            others = [j for j in range(len(self.tables)) if j != i]
            skip, first = untrained_rows(ids, self.tables, self.offsets, others, self.has_row)
            if first is not None and untrained == "refuse":
                raise untrained_error(first)
        col, ids = self.offsets[i], ids.long()

        def score(a: int, b: int, pos: torch.Tensor) -> torch.Tensor:
            n = len(pos)
            x = ids[a:b].repeat_interleave(n, 0)
            x[:, col] = items[pos].to(x.device).repeat(b - a)
            return self(dense[a:b].repeat_interleave(n, 0), x).view(b - a, n)

        keys = rank(score, ids.shape[0], len(items), k, off, batch)
        keys[skip] = NO_ITEM
        return decode(keys, items)

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
    forward (and predict) score each row's own item: <query, candidate> [B]. A row whose
    user id (the model's `user_feature`) has no trained row is refused, or given an empty
    list, as `untrained` says (InferenceModel.topk)."""

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
    def query(self, dense: torch.Tensor, ids: torch.Tensor, raw: bool = False) -> torch.Tensor:
        """User vectors [B, D] of rows dense [B, F], ids [B, H] (inputs checked; only the
        user tower's features are read, the others may hold any valid id; `raw`: dense holds
        raw values)."""
        dense = self.dense_inputs(dense, raw)
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
        *,
        raw: bool = False,
        untrained: str = "refuse",
        batch: int = SCORES_PER_BLOCK,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best items of the catalogue for each row's user (class docstring);
        `exclude[i]`: item ids row i must not get (the items its user has met); `raw` and
        `untrained` as InferenceModel.topk's (only the user feature is checked); `batch`:
        (user, item) dot products computed at once."""
        k, untrained = check_k(k), check_untrained(untrained)
        if self.item_ids is None or self.item_vectors is None:
            raise ValueError(
                "this export has no item vectors: write it with hybridrec-export --retrieval"
            )
        q = self.query(dense, ids, raw)
        off = excluded_positions(exclude, ids.shape[0], self.item_ids)
        skip = torch.zeros(ids.shape[0], dtype=torch.bool)
        if untrained != "score":
            user = [t.name for t in self.tables].index(self.net.user_feature)
            skip, first = untrained_rows(ids, self.tables, self.offsets, [user], self.has_row)
            if first is not None and untrained == "refuse":
                raise untrained_error(first)
        vectors = self.item_vectors.to(q.device)

        def score(a: int, b: int, pos: torch.Tensor) -> torch.Tensor:
            return q[a:b] @ vectors[pos.to(q.device)].T

        keys = rank(score, ids.shape[0], len(self.item_ids), k, off, batch)
        keys[skip] = NO_ITEM
        return decode(keys, self.item_ids)


class NextItemExport(NextItemServing, InferenceModel):
    """A next-item model (model.task=next_item) for serving: the user encoder (the sequence
    model) and the catalogue's item vectors (`item_ids` [N] as the data file numbers items,
    `item_vectors` [N, D]); `topk(histories, k, exclude="history")`, `query(histories)`,
    `score(histories, items)`, equal to the trainer's evaluation
    (hybridrec.next_item_serving)."""


EXPORTS = {"retrieval": RetrievalExport, "next_item": NextItemExport}  # model.task -> class


def load_export(
    path: str | Path,
    cfg: ModelConfig | None = None,
    model: type[nn.Module] | str | None = None,
    *,
    trust_import: object = None,
) -> Scorer:
    """The model in a hybridrec-export file (an InferenceModel; a RetrievalExport for
    model.task=retrieval, a NextItemExport for model.task=next_item). `cfg`: the model
    config, needed only for files written before exports carried it (its `_target_`, the
    caller's own config, is imported); shapes are checked either way. `model`: the class a
    file of a `model._target_` model was trained with, or its import path (module
    docstring); a built-in model needs none. `trust_import` (older versions imported the
    file's `_target_` with it) is refused, naming `model=`."""
    if trust_import is not None:
        raise ValueError(
            "load_export(trust_import=...) is gone: nothing an export names is imported; name "
            "the class you trained instead: load_export(path, model=YourClass) or "
            "model='pkg.Class'"
        )
    path = Path(path)
    if path.is_dir() and (
        (path / "manifest.json").is_file() or any(path.glob("step_*/manifest.json"))
    ):
        raise ValueError(
            f"{path} is a checkpoint directory, not an exported model: write one with "
            f"`hybridrec-export {path} model.pt` and load that file"
        )
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
        cfg = model_config(path, state[MODEL_CONFIG_KEY], allow_target=model is not None)
        cls = named_class(path, cfg, model)
    elif model is not None:
        cls = named_class("the config passed", cfg, model)
    else:  # the caller's own config names the class
        cls = import_class(cfg._target_) if cfg._target_ else MODELS[cfg.arch]
    net = EXPORTS.get(cfg.task, InferenceModel)(cfg, cls)
    params = net.expected()
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
    load_rows(weights, net.storages)  # every shard of the storage from the file's tables
    read_record(path, state, net)
    if isinstance(net, RetrievalExport) and ITEM_IDS in state:
        ids, order = state[ITEM_IDS].long().sort()  # ascending: the tie order's premise
        net.item_ids, net.item_vectors = ids, state[ITEM_VECTORS].float()[order]
    if isinstance(net, NextItemExport) and ITEM_IDS in state:
        rows = net.tables[net.names.index("seq")].num_rows
        net.item_ids, net.item_vectors = check_catalogue(
            path, state[ITEM_IDS], state.get(ITEM_VECTORS), rows
        )
    return net.eval()


def read_record(path: Path, state: dict, net: Scorer) -> None:
    """What the export recorded of its dataset (hybridrec.serving) into `net`; ValueError
    naming the file for entries that do not fit the model."""
    if TRANSFORMS_KEY in state:
        net.dense_transforms = DenseTransforms.from_json(state[TRANSFORMS_KEY], str(path))
        if len(net.dense_transforms.kinds) != net.num_dense:
            raise ValueError(
                f"{path}: {TRANSFORMS_KEY} has {len(net.dense_transforms.kinds)} columns, the "
                f"model {net.num_dense} dense inputs"
            )
    rows = {t.name: t.num_rows for t in net.tables}
    for key, mask in state.items():
        if key.startswith(TRAINED_PREFIX):
            name = key[len(TRAINED_PREFIX) :]
            if (
                name not in rows
                or not isinstance(mask, torch.Tensor)
                or mask.shape != (rows[name],)
            ):
                raise ValueError(f"{path}: {key} is not a row mask of one of the model's features")
            net.trained[name] = mask.bool()
