"""Per-table pins (sharding.tables) == the single-process reference.

Mixed plans where some tables are pinned to a mode and the planner places the rest around
them: on 2 and 3 gloo ranks, compared after several optimizer steps like test_equivalence
(logits, losses, every row and its optimizer state, dense weights). The host-pinned table
has a cache of two batches' ids, so it evicts and writes rows back.
"""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_shared
from tests.equivalence import cached_reference, compare, make_cfg, run_all

pytestmark = pytest.mark.slow

CASES = {
    # the mode plans cat_1 and cat_2 whole; the pins cover every other kind
    "table_wise/rowwise_adagrad": {
        "cat_0": "data_parallel",
        "cat_3": "column_wise",
        "cat_4": "row_wise",
    },
    "auto/adam": {"cat_4": "host", "cat_1": "table_wise", "cat_3": "row_wise"},
    "row_wise/sgd": {"cat_2": "table_wise", "cat_3": "host"},
}


@pytest.mark.parametrize("world", [2, 3])
def test_pinned_plans_match_reference(world):
    configs = []
    for name, pins in CASES.items():
        mode, sparse = name.split("/")
        cfg = make_cfg(mode, sparse, world)
        cfg.sharding.tables = dict(pins)
        cfg.sharding.cache_fraction = 0.001  # the planner's floor: two batches' ids
        configs.append((name, cfg))
    results = run_shared(world, run_all, configs)
    for name, cfg in configs:
        per_rank = [res[name] for res in results]
        plan = per_rank[0]["plan"]
        for table, mode in CASES[name].items():
            tp = plan.table(table)
            assert tp.reason.startswith("pinned by sharding.tables"), tp
            assert (mode == "host") == all(s.on_host for s in tp.shards), tp
        ref = cached_reference(name.split("/")[1])
        compare(ref, per_rank, cfg, f"W={world} {name}")
