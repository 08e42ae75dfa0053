"""The next-item softmax (hybridrec.train.next_item.next_item_softmax_loss) on W gloo ranks ==
one process on the global batch, at W = 2 and 3: each rank holds its slice of the sequences,
with a different number of training positions (the ranks pad to the largest), and the mean
of the ranks' losses and each rank's gradients (times W, the gradient-scaling convention of
hybridrec.shard) equal the one-process loss and its gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybridrec.train.next_item import next_item_softmax_loss
from tests.distributed.harness import run_shared

pytestmark = pytest.mark.slow
B, L, D, ITEMS = 6, 5, 4, 9


def case() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor([5, 1, 0, 4, 2, 5])  # rank slices hold different counts
    mask = torch.arange(L) < lengths.unsqueeze(1)
    ids = torch.randint(0, ITEMS, (B, L), generator=g).masked_fill(~mask, -1)
    hidden = torch.randn(B, L, D, generator=g)
    table = torch.randn(ITEMS, D, generator=g)
    neg_ids = torch.tensor([1, 7])
    log_q = torch.rand(ITEMS, generator=g).log()
    return hidden, table, ids, mask, neg_ids, log_q


def loss_and_grads(group, rows: slice) -> dict:  # noqa: ANN001
    hidden, table, ids, mask, neg_ids, log_q = case()
    hidden = hidden[rows].clone().requires_grad_(True)
    table = table.clone().requires_grad_(True)
    ids, mask = ids[rows], mask[rows]
    pos = table[ids.clamp(min=0)] * mask.unsqueeze(-1)
    loss = next_item_softmax_loss(
        hidden, pos, ids, mask, table[neg_ids], neg_ids, group=group, temperature=0.5,
        log_q=log_q,
    )  # fmt: skip
    loss.backward()
    return {"loss": loss.detach(), "hidden": hidden.grad, "table": table.grad}


def on_rank(env) -> dict:  # noqa: ANN001
    world, rank = dist.get_world_size(env.group), dist.get_rank(env.group)
    per = B // world
    return loss_and_grads(env.group, slice(rank * per, (rank + 1) * per))


@pytest.mark.parametrize("world", [2, 3])
def test_next_item_softmax_over_ranks_equals_one_process(world):
    want = loss_and_grads(None, slice(0, B))
    ranks = run_shared(world, on_rank)
    tol = {"rtol": 1e-5, "atol": 1e-6}
    mean = torch.stack([r["loss"] for r in ranks]).mean()
    torch.testing.assert_close(mean, want["loss"], **tol)
    hidden = torch.cat([r["hidden"] for r in ranks]) / world
    torch.testing.assert_close(hidden, want["hidden"], **tol)
    # the table's gradient: each rank's own lookups (positives and negatives), summed
    table = torch.stack([r["table"] for r in ranks]).sum(0) / world
    torch.testing.assert_close(table, want["table"], **tol)
