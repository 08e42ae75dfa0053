"""Serving a next-item model trained on 2 gloo ranks with its item table sharded row-wise:
hybridrec-export of the run's checkpoint (its shards reassembled), loaded in one process,
ranks every test user's held-out item where the trainer's evaluation on the 2 ranks ranked it
(full catalogue and the sampled protocol, user for user), and its lists give the trainer's
hr@K and ndcg@K (tests/sequence/export_check.py; one rank: tests/sequence/test_export.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import run_shared
from tests.sequence.export_check import (
    check_export,
    export,
    make_cfg,
    train_and_rank,
    write_events,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed/test_next_item_export")]


def run_cases(env, configs: list) -> dict:  # noqa: ANN001
    return {name: train_and_rank(env, cfg) for name, cfg in configs}


@pytest.mark.parametrize("case", ["sasrec_bce", "hstu_softmax"])
def test_export_of_a_two_rank_run_equals_its_evaluation(tmp_path: Path, case: str):
    data = write_events(tmp_path / "events.txt")
    cfg = make_cfg(data, case, "row_wise", 2, tmp_path / "ck")
    ranks = run_shared(2, run_cases, [(case, cfg)], timeout=900)
    want = ranks[0][case]
    for r in ranks[1:]:  # every rank holds the same evaluation
        assert r[case]["metrics"] == want["metrics"]
        assert (r[case]["full"] == want["full"]).all()
    check_export(export(tmp_path / "ck", tmp_path / "model.pt"), data, want)
