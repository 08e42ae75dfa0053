"""What the exact-mode suites share (tests/distributed/test_exact.py, test_exact_long.py): the
library's training loop in exact mode and the bitwise comparisons against one process."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import hybridrec
from hybridrec.config import Config
from hybridrec.distributed import DistEnv
from hybridrec.planner import CachePolicy
from hybridrec.sparse.api import embedding_modules
from hybridrec.types import KeyedIds
from tests.distributed import dynamic_model, sequence_model
from tests.equivalence import assemble
from tests.libmodel import OPTIMIZERS, assemble_tables, shard_copies


def bce(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(out, labels)


def train_library(env: DistEnv, case: tuple, steps: int, m: int) -> dict:
    """The dynamic-table or sequence model of case (sharding, pins, sparse, variant) through
    hybridrec.parallelize(exact_shards=m) and hybridrec.exact_step, `steps` steps."""
    sharding, pins, sparse, variant = case
    if isinstance(variant, str):  # dynamic tables: a policy set
        make, data, features, batch = (
            lambda: dynamic_model.TwoSided(variant),
            dynamic_model.batches(steps),
            dynamic_model.FEATURES,
            dynamic_model.B,
        )
    else:
        make, data, features, batch = (
            lambda: sequence_model.Sequential(variant),
            sequence_model.batches(variant, steps),
            sequence_model.FEATURES,
            sequence_model.B,
        )
    torch.manual_seed(0)
    model = hybridrec.parallelize(
        make(), batch_size=batch, sparse_optimizer=OPTIMIZERS[sparse](), group=env.group,
        sharding=sharding, pins=pins, cache=CachePolicy(fraction=0.1), seed=11,
        exact_shards=m,
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    world = env.world_size
    part = slice(env.rank * batch // world, (env.rank + 1) * batch // world)
    names, hotness = zip(*features, strict=True)
    losses = []
    for dense, ids, labels in data[:steps]:
        keyed = KeyedIds(ids[part], names, hotness)
        losses.append(hybridrec.exact_step(model, bce, dense[part], keyed, labels[part]))
        opt.step()
        opt.zero_grad()
    maps = [
        (d.table.name, d.clock)
        for m in embedding_modules(model)
        for g in m.groups.values()
        for _, d in g.dynamic()
    ]
    return {
        "losses": torch.stack(losses),
        "shards": shard_copies(model),
        "dense": {k: v.detach().clone() for k, v in model.named_parameters()},
        "maps": maps,
    }


def assert_same_tables(cfg_or_rows: Any, ref: dict, per_rank: list[dict], label: str) -> None:
    """Every row and optimizer-state entry torch.equal, reassembled from all ranks."""
    if isinstance(cfg_or_rows, Config):
        got, want = assemble(cfg_or_rows, per_rank), assemble(cfg_or_rows, [ref])
    else:
        rows, dims = cfg_or_rows
        got, want = assemble_tables(per_rank, rows, dims), assemble_tables([ref], rows, dims)
    for table, entries in want.items():
        for name, value in entries.items():
            assert not got[table][name].isnan().any(), f"{label} {table}.{name}: not covered"
            assert torch.equal(got[table][name], value), f"{label}: {table}.{name} differs"


def assert_same_dense(ref: dict, per_rank: list[dict], label: str) -> None:
    for r, res in enumerate(per_rank):
        for k, v in ref["dense"].items():
            assert torch.equal(res["dense"][k], v), f"{label}: rank {r}'s dense {k} differs"


def map_arrays(results: list[dict]) -> dict[tuple[str, str], torch.Tensor]:
    """Every dynamic map's per-slot arrays (the shards' "dyn_*" state) over all its rows;
    column shards' copies must agree."""
    out: dict[tuple[str, str], torch.Tensor] = {}
    for res in results:
        for spec, _, state in res["shards"]:
            for key, value in state.items():
                if key.startswith("dyn_"):
                    buf = out.setdefault((spec.table, key), torch.full((spec.row_end,), -7))
                    if buf.numel() < spec.row_end:
                        buf = out[(spec.table, key)] = torch.cat(
                            [buf, buf.new_full((spec.row_end - buf.numel(),), -7)]
                        )
                    buf[spec.row_start : spec.row_end] = value
    return out


def assert_same_maps(ref: dict, per_rank: list[dict], label: str) -> None:
    """Every dynamic map's arrays and clock torch.equal to the reference's."""
    want, got = map_arrays([ref]), map_arrays(per_rank)
    assert set(got) == set(want), f"{label}: maps {sorted(got)} vs {sorted(want)}"
    for key, value in want.items():
        assert torch.equal(got[key], value.to(got[key].dtype)), f"{label}: map {key} differs"
    clocks = {clock for res in per_rank for *_, clock in res["maps"]}
    assert clocks <= {clock for *_, clock in ref["maps"]}, f"{label}: map clocks {clocks}"
