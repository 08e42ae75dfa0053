"""Scoring with the training lookup: a model's declared tables given the trainer's own storage,
in one process, for `predict` and exports (hybridrec.inference).

`attach_scoring(model)` gives every EmbeddingTables of `model` a ScoringCollection: the
trainer's EmbeddingCollection (hybridrec.sparse.collection: the sharded collection on a
one-rank plan, each table whole, fused groups by width) with no sparse optimizer, no process
group and no id checks of its own (InferenceModel.predict checks its inputs first), held in
evaluation mode. Its lookups are the trainer's evaluation lookups, code path for code path:
pooling (sum, mean, jagged bags, empty bags), shared tables, and dynamic tables, whose maps
only look raw ids up (never admit): an id without a row gets its bucket's unknown row
(unknown="row") or adds nothing (it still counts in a mean), as in the trainer's evaluation.
So there is one lookup to keep right, not a second implementation of it
(tests/train/test_scoring_storage.py compares the two on every table kind).

`load_rows(state, modules)` fills embedding modules' shards from an export's whole tables:
`embeddings.<table>.weight` [rows, dim] sliced to each shard's rows and columns, and a dynamic
table's `embeddings.<table>.slot_id` [rows] (the raw id each row holds, -1: none) into its
map's `dyn_slot_id` state view (the map rebuilds its index from it before its next lookup).
It is the one rule for reading an export into storage: load_export uses it, and so does a
warm start on any plan (model.init_from: hybridrec.train.checkpoint.export).

This module sits above hybridrec.sparse and hybridrec.model (the model layer never imports the
storage: docs/architecture.md, Layering) and never imports torch.distributed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from hybridrec.model.tables import declared_tables
from hybridrec.sparse.api import EmbeddingModule
from hybridrec.sparse.collection import EmbeddingCollection, local_plan
from hybridrec.types import TableConfig, storage_tables


class ScoringCollection(EmbeddingCollection):
    """The trainer's single-process storage of `features` (TableConfig per feature, named as
    exports name them), for scoring: no optimizer (no gradient reaches its rows), no id checks,
    always in evaluation mode (its dynamic maps never admit). `.to(device)` moves it whole."""

    def __init__(self, features: Sequence[TableConfig], device: torch.device | str = "cpu"):
        super().__init__(features, None, device=device, check_ids=False)
        super().train(False)
        # what it was built from (a move rebuilds it): its own, not the base class's fields
        self.features, self.home = tuple(features), torch.device(device)

    def train(self, mode: bool = True) -> ScoringCollection:
        """Evaluation whatever `mode` is: a scoring lookup changes no map and no row."""
        return super().train(False)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's hook)
        """`.to(device)`, `.cuda()`, `.cpu()`: the storage keeps tensors derived for its device
        beside its buffers (bag layouts, routes, map indexes), so a move to another device
        builds it there and copies its rows and maps (its shard views) over."""
        target = fn(torch.zeros(())).device
        if target != self.home:
            moved = ScoringCollection(self.features, target)
            copy_shards(self, moved)
            vars(self).update(vars(moved))
        return super()._apply(fn, recurse)


def attach_scoring(model: nn.Module, device: torch.device | str = "cpu") -> list[ScoringCollection]:
    """Give every EmbeddingTables of `model` a ScoringCollection of its features, named as
    plans, checkpoints and exports name them ("<namespace>.<name>"); returns them in module
    order. Their rows are freshly initialised until `load_rows` fills them."""
    out: list[ScoringCollection] = []
    for path, tables in declared_tables(model):
        features = tables.qualified(path)
        storage = ScoringCollection(features, device)
        tables.attach(storage, local_plan(features))
        out.append(storage)
    return out


def export_views(modules: Sequence[ScoringCollection]) -> dict[str, torch.Tensor]:
    """The export keys scoring collections read, to the tensors they are (each holds its
    tables whole): `embeddings.<table>.weight` -> its rows [rows, dim], and a dynamic table's
    `embeddings.<table>.slot_id` -> its map's slot ids [rows]. A write into them takes effect
    at the next lookup."""
    out = {}
    for m in modules:
        tables = {t.name: t for t in storage_tables(m.features)}
        for spec, weight, state in m.shard_views():
            t = tables[spec.table]
            assert (spec.num_rows, spec.width) == (t.num_rows, t.dim), f"{t.name} is not whole"
            out[f"embeddings.{spec.table}.weight"] = weight
            if "dyn_slot_id" in state:
                out[f"embeddings.{spec.table}.slot_id"] = state["dyn_slot_id"]
    return out


@torch.no_grad()
def load_rows(state: Mapping[str, torch.Tensor], modules: Sequence[EmbeddingModule]) -> None:
    """Fill every shard of `modules` from an export's whole tables (module docstring); each
    shard's `embeddings.<table>.weight` must be in `state` (KeyError otherwise: callers check
    the file's keys and shapes first); a dynamic shard takes its slot ids when `state` has
    them, else keeps its map."""
    for m in modules:
        for spec, weight, st in m.shard_views():
            rows, cols = slice(spec.row_start, spec.row_end), slice(spec.col_start, spec.col_end)
            weight.copy_(state[f"embeddings.{spec.table}.weight"][rows, cols])
            slot_id = state.get(f"embeddings.{spec.table}.slot_id")
            if "dyn_slot_id" in st and slot_id is not None:  # a dynamic table keeps its ids' rows
                st["dyn_slot_id"].copy_(slot_id[rows])


@torch.no_grad()
def copy_shards(src: EmbeddingModule, dst: EmbeddingModule) -> None:
    """`dst`'s shards (the same plan as `src`'s, on any device) given `src`'s rows, optimizer
    state and dynamic maps."""
    for (a, wa, sa), (b, wb, sb) in zip(src.shard_views(), dst.shard_views(), strict=True):
        assert a == b, f"different shards: {a} and {b}"
        wb.copy_(wa)
        for name, view in sa.items():
            sb[name].copy_(view)
