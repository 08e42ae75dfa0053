"""hybridrec.kernels.pages: huge pages asked for large CPU tensors only, and tables that got
them train exactly as before (the advice changes where memory lives, never a value)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrec.kernels.pages import HUGE, huge_pages
from hybridrec.sparse.fused import FusedEmbedding, LookupInput
from hybridrec.types import ShardSpec, TableConfig


def _thp_on() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[madvise]" in mode or "[always]" in mode


def test_small_tensors_are_left_alone():
    assert not huge_pages(torch.empty(HUGE // 4))  # under two huge pages
    assert not huge_pages(torch.empty(0))


@pytest.mark.skipif(not _thp_on(), reason="transparent huge pages are off here")
def test_large_cpu_tensors_get_the_advice():
    assert huge_pages(torch.empty(4 * HUGE // 4))


def test_a_group_with_huge_pages_trains_as_before():
    t = TableConfig("t", 70_000, 16)  # 4.5 MB of rows: advised
    shard = ShardSpec("t", 0, 0, t.num_rows, 0, t.dim)
    from hybridrec.optim.sparse import SparseAdam

    groups = [FusedEmbedding([(t, 0, shard)], SparseAdam(0.01), seed=3) for _ in range(2)]
    ids = torch.randint(0, t.num_rows, (512,), generator=torch.Generator().manual_seed(0))
    bags = torch.arange(512)
    for g in groups[1:]:  # the other copy's rows and state moved to fresh small-page memory
        g.weight = g.weight.clone()
        for name in g.state_names:
            setattr(g, f"state_{name}", getattr(g, f"state_{name}").clone())
    for g in groups:
        for _ in range(2):
            g([LookupInput(ids, bags, 512)])[0].sum().backward()
    assert torch.equal(groups[0].weight, groups[1].weight)
    assert torch.equal(groups[0].state_exp_avg, groups[1].state_exp_avg)
