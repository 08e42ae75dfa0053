"""Optimizer state of width-1 shards through a checkpoint's rectangles (load_embeddings).

Element-wise state is [rows, cols] like the weight, [rows, 1] for a width-1 shard; row-wise
state is [rows]. Checkpoints of older versions hold a width-1 shard's element-wise state as
[rows]: they load too. A width-2 table saved as two column shards of width 1 must load into
the whole table and back into width-1 shards, every value where it was.
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.config import SparseOptimConfig
from hybridrec.optim import build_sparse_optimizer
from hybridrec.sparse.fused import FusedEmbedding
from hybridrec.sparse.layout import full_shard
from hybridrec.train.checkpoint.format import write_file
from hybridrec.train.checkpoint.load import load_embeddings
from hybridrec.types import ShardSpec, StateKind, TableConfig

TABLE = TableConfig("t", 10, 2)
COLUMNS = [ShardSpec("t", 0, 0, 10, c, c + 1) for c in range(2)]


def _save(tmp_path, groups: list[FusedEmbedding], older: bool) -> dict:
    """The groups' shards written as save.py writes them (`older`: element-wise state of a
    width-1 shard flattened to [rows]); returns the manifest's part load_embeddings reads."""
    shards = [
        {
            "table": spec.table,
            "rows": (spec.row_start, spec.row_end),
            "cols": (spec.col_start, spec.col_end),
            "weight": w.clone(),
            "state": {k: (v.reshape(-1) if older else v).clone() for k, v in st.items()},
        }
        for g in groups
        for spec, w, st in g.shard_views()
    ]
    write_file({"shards": shards}, tmp_path / "shards_rank0.pt")
    return {
        "shards": [
            {
                "file": "shards_rank0.pt",
                "index": i,
                "table": s["table"],
                "rows": list(s["rows"]),
                "cols": list(s["cols"]),
                "state": sorted(s["state"]),
            }
            for i, s in enumerate(shards)
        ]
    }


@pytest.mark.parametrize("older", [False, True])
@pytest.mark.parametrize("opt", ["adam", "adagrad", "rowwise_adagrad"])
def test_width_one_shards_state_reshards_through_a_checkpoint(tmp_path, opt, older):
    cfg = SparseOptimConfig(name=opt)
    kinds = build_sparse_optimizer(cfg).state_spec()
    saved = [FusedEmbedding([(TABLE, 0, s)], build_sparse_optimizer(cfg), seed=1) for s in COLUMNS]
    g = torch.Generator().manual_seed(0)
    row_values = {}  # row-wise state: the same in every column shard of a row
    for group in saved:
        group.weight.copy_(torch.randn(group.weight.shape, generator=g))
        for name, st in group.state().items():
            assert st.shape == ((10,) if kinds[name] == StateKind.ROW else (10, 1)), name
            if kinds[name] == StateKind.ROW:
                st.copy_(row_values.setdefault(name, torch.rand(10, generator=g)))
            else:
                st.copy_(torch.rand(st.shape, generator=g))
    manifest = _save(tmp_path, saved, older)

    whole = FusedEmbedding([(TABLE, 0, full_shard(TABLE))], build_sparse_optimizer(cfg), seed=2)
    load_embeddings(tmp_path, manifest, [whole])
    assert torch.equal(whole.weight, torch.cat([s.weight for s in saved], 1))
    for name, kind in kinds.items():
        parts = [s.state()[name] for s in saved]
        want = parts[0] if kind == StateKind.ROW else torch.cat(parts, 1)
        assert torch.equal(whole.state()[name], want), name

    again = [FusedEmbedding([(TABLE, 0, s)], build_sparse_optimizer(cfg), seed=3) for s in COLUMNS]
    load_embeddings(tmp_path, manifest, again)
    for a, b in zip(again, saved, strict=True):
        assert torch.equal(a.weight, b.weight)
        for name, value in b.state().items():
            assert torch.equal(a.state()[name], value), name
