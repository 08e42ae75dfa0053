"""Scoring, `predict` and exports look ids up through the training lookup
(hybridrec.scoring): on every table kind, a model trained with hybridrec.parallelize on one
process, its rows (and dynamic maps) written out as an export writes them and loaded into the
scoring storage, looks up exactly what the trained storage looks up in evaluation (eval mode,
no grad): plain tables, sum and mean pooling, jagged lists (with empty bags), a table shared
by two features, mixed widths, dynamic tables with unknown=zeros and unknown=row (ids with and
without rows), and host-memory tables planned on one rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridrec
from hybridrec import Dynamic, EmbeddingTables, Feature, Table
from hybridrec.optim import SparseAdagrad
from hybridrec.planner import CachePolicy
from hybridrec.scoring import ScoringCollection, attach_scoring, load_rows
from hybridrec.sparse.api import embedding_modules
from hybridrec.types import storage_tables

B, STEPS = 16, 5
DYN_ZEROS = Dynamic(evict="lru", buckets=4)
DYN_ROW = Dynamic(admit="count", min_count=2, evict="lfu", halflife=2, unknown="row", buckets=4)

# kind -> (tables, features, sharding)
KINDS = {
    "plain": ([Table("a", 50, 4), Table("b", 30, 4)], None, "none"),
    "pooling": (
        [Table("a", 50, 4), Table("b", 30, 4)],
        [Feature("a3", "a", hotness=3), Feature("b2", "b", hotness=2, pooling="mean")],
        "none",
    ),
    "jagged": (
        [Table("a", 50, 4), Table("b", 30, 4)],
        [
            Feature("a", "a", hotness=4, jagged=True, pooling="mean"),
            Feature("b", "b", hotness=3, jagged=True),
        ],
        "none",
    ),
    "shared": (
        [Table("user", 60, 4), Table("age", 7, 4)],
        [
            Feature("user_id", "user"),
            Feature("friends", "user", hotness=3, jagged=True, pooling="mean"),
            Feature("age", "age"),
        ],
        "none",
    ),
    "widths": (
        [Table("a", 50, 4), Table("b", 30, 8), Table("c", 20, 4)],
        [Feature("a", "a", hotness=2, pooling="mean"), Feature("b", "b"), Feature("c", "c")],
        "none",
    ),
    # one width: the dynamic table in the one sample-major group (its columns remapped)
    "dynamic_zeros": (
        [Table("user", 32, 4, dynamic=DYN_ZEROS), Table("age", 7, 4)],
        [
            Feature("user_id", "user"),
            Feature("friends", "user", hotness=3, jagged=True, pooling="mean"),
            Feature("age", "age"),
        ],
        "none",
    ),
    "dynamic_row": (
        [Table("user", 32, 4, dynamic=DYN_ROW), Table("age", 7, 4)],
        [
            Feature("user_id", "user"),
            Feature("friends", "user", hotness=3, jagged=True, pooling="mean"),
            Feature("age", "age"),
        ],
        "none",
    ),
    # two widths: each dynamic table a group of its own (its routed ids remapped)
    "dynamic_widths": (
        [
            Table("user", 32, 8, dynamic=DYN_ROW),
            Table("item", 24, 4, dynamic=DYN_ZEROS),
            Table("age", 7, 4),
        ],
        [
            Feature("user_id", "user"),
            Feature("friends", "user", hotness=3, jagged=True, pooling="mean"),
            Feature("item", "item", hotness=2),
            Feature("age", "age"),
        ],
        "none",
    ),
    "host": (
        [Table("a", 400, 4), Table("user", 32, 4, dynamic=DYN_ROW), Table("b", 300, 8)],
        [
            Feature("a", "a", hotness=3, jagged=True, pooling="mean"),
            Feature("user", "user", hotness=2),
            Feature("b", "b"),
        ],
        "host",
    ),
}


class Holder(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        tables, features, _ = KINDS[kind]
        self.tables = EmbeddingTables(tables, features, namespace="t")


def batch(declared: EmbeddingTables, g: torch.Generator, pool: int) -> torch.Tensor:
    """ids [B, H] of the declaration's features: skewed ids, lists of 0..hotness ids (some
    empty); a dynamic table's are raw 40-bit ids from `pool` distinct ones."""
    raw = torch.randint(0, 1 << 40, (pool,), generator=torch.Generator().manual_seed(5))
    cols = []
    for f in declared.features:
        n = pool if f.dynamic is not None else f.num_rows
        ids = (torch.rand(B, f.hotness, generator=g) ** 2 * n).long()
        if f.dynamic is not None:
            ids = raw[ids]
        if f.jagged:
            length = torch.randint(0, f.hotness + 1, (B, 1), generator=g)
            length[0] = 0  # an empty bag
            ids[torch.arange(f.hotness).expand(B, f.hotness) >= length] = -1
        cols.append(ids)
    return torch.cat(cols, 1)


def trained(kind: str) -> tuple[nn.Module, list[torch.Tensor]]:
    """A Holder parallelized on one process and trained STEPS steps; and evaluation batches
    (drawn from more raw ids than training met: some have rows, some do not)."""
    model = hybridrec.parallelize(
        Holder(kind),
        batch_size=B,
        sparse_optimizer=SparseAdagrad(0.5),
        sharding=KINDS[kind][2],
        cache=CachePolicy(fraction=0.1),
        seed=3,
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        pooled = model.tables(batch(model.tables, g, 60)).tensor
        (pooled * torch.linspace(-1, 1, pooled.numel()).view_as(pooled)).sum().backward()
    return model, [batch(model.tables, g, pool) for pool in (60, 200)]


def exported_rows(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tables as an export holds them: embeddings.<table>.weight [rows, dim] and
    a dynamic table's embeddings.<table>.slot_id [rows], from its shards."""
    out: dict[str, torch.Tensor] = {}
    for t in storage_tables(model.tables.qualified("tables")):
        out[f"embeddings.{t.name}.weight"] = torch.full((t.num_rows, t.dim), torch.nan)
        if t.dynamic is not None:
            out[f"embeddings.{t.name}.slot_id"] = torch.full((t.num_rows,), -2)
    for m in embedding_modules(model):
        for g in m.host_groups():
            g.flush()  # host tables: cached rows back into host memory
        for spec, w, st in m.shard_views():
            rows = slice(spec.row_start, spec.row_end)
            out[f"embeddings.{spec.table}.weight"][rows, spec.col_start : spec.col_end] = w
            if "dyn_slot_id" in st:
                out[f"embeddings.{spec.table}.slot_id"][rows] = st["dyn_slot_id"]
    for k, v in out.items():  # every row written
        assert not (v.isnan().any() if v.is_floating_point() else (v == -2).any()), k
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_scoring_looks_up_what_the_trained_storage_looks_up(kind):
    model, evals = trained(kind)
    state = exported_rows(model)
    scoring = Holder(kind)
    modules = attach_scoring(scoring)
    assert [type(m) for m in modules] == [ScoringCollection]
    load_rows(state, modules)
    model.eval()
    dynamic = [t for t in KINDS[kind][0] if t.dynamic is not None]
    for ids in evals:
        with torch.no_grad():
            want = model.tables(ids).tensor
            got = scoring.tables(ids).tensor
        assert torch.equal(got, want), (got - want).abs().max()
    if dynamic:  # the evaluation met ids with rows and ids without
        [m] = modules
        counts = m.take_eval_unknown().dynamic
        for t in dynamic:
            ids, unknown = counts[f"t.{t.name}"].eval_ids, counts[f"t.{t.name}"].eval_unknown
            assert 0 < unknown < ids, (t.name, ids, unknown)


def test_a_scoring_storage_never_admits_and_moves_whole():
    model, evals = trained("dynamic_row")
    scoring = Holder("dynamic_row")
    [m] = attach_scoring(scoring)
    load_rows(exported_rows(model), [m])
    ids = evals[1]
    with torch.no_grad():
        want = scoring.tables(ids).tensor

    def user_map() -> dict[str, torch.Tensor]:
        [state] = [st for spec, _, st in m.shard_views() if spec.table == "t.user"]
        return state

    held = {k: v.clone() for k, v in user_map().items()}
    assert (held["dyn_slot_id"] >= 0).any()
    scoring.train()  # stays in evaluation: a lookup with grad admits nothing, trains nothing
    got = scoring.tables(ids).tensor
    assert not m.training and not got.requires_grad and torch.equal(got, want)
    assert all(torch.equal(v, held[k]) for k, v in user_map().items())
    # a move to another device builds the storage there with the same rows and maps; here it
    # is told it lives elsewhere and moves to the CPU, so the rebuild runs without a GPU
    before = m.shard_views()[0][1].data_ptr()
    m.home = torch.device("meta")
    scoring.to("cpu")
    assert m.home == torch.device("cpu") and m.shard_views()[0][1].data_ptr() != before
    assert torch.equal(scoring.tables(ids).tensor, want)
