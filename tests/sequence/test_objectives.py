"""The next-item objectives against hand computations: SASRec's sampled binary
cross-entropy (hybridrec.model.next_item) and the in-batch softmax with logQ
(hybridrec.train.next_item, through the retrieval task's retrieval_loss); the helpers that
cut a looked-up sequence into inputs and targets. Several ranks: tests/distributed/
test_next_item.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridrec.config.schema import RetrievalConfig
from hybridrec.model.next_item import last_states, sampled_bce_loss, shift
from hybridrec.train.next_item import next_item_objective, next_item_softmax_loss
from hybridrec.train.retrieval import retrieval_loss


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_sampled_bce_by_hand():
    hidden = torch.tensor([[[1.0, 0.0], [0.5, 2.0]], [[-1.0, 1.0], [0.0, 0.0]]])
    pos = torch.tensor([[[2.0, 1.0], [1.0, -1.0]], [[0.5, 0.5], [3.0, 3.0]]])
    neg = torch.tensor(
        [
            [[[1.0, 1.0], [0.0, -2.0]], [[1.0, 0.0], [2.0, 2.0]]],
            [[[-1.0, 0.0], [0.0, 1.0]], [[9.0, 9.0], [9.0, 9.0]]],
        ]
    )  # [B=2, L=2, N=2, D=2]
    mask = torch.tensor([[True, True], [True, False]])
    want = 0.0
    for b, i in ((0, 0), (0, 1), (1, 0)):
        h = hidden[b, i].tolist()

        def dot(v, h=h):  # noqa: ANN001, ANN202
            return sum(x * y for x, y in zip(h, v.tolist()))

        want -= math.log(sig(dot(pos[b, i])))
        want -= sum(math.log(1 - sig(dot(neg[b, i, n]))) for n in range(2))
    got = sampled_bce_loss(hidden, pos, neg, mask)
    assert got.item() == pytest.approx(want / 3, rel=1e-6)
    half = sampled_bce_loss(hidden, pos, neg, mask, denominator=6.0)
    assert half.item() == pytest.approx(want / 6, rel=1e-6)
    with pytest.raises(ValueError, match=r"negatives must be \[B, L, N, D\]"):
        sampled_bce_loss(hidden, pos, neg[:, :, 0], mask)


def test_one_negative_is_sasrecs_two_means():
    g = torch.Generator().manual_seed(0)
    hidden, pos, neg = (torch.randn(3, 4, 5, generator=g) for _ in range(3))
    mask = torch.rand(3, 4, generator=g) > 0.3
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    p, n = (hidden * pos).sum(-1)[mask], (hidden * neg).sum(-1)[mask]
    want = bce(p, torch.ones_like(p)) + bce(n, torch.zeros_like(n))  # SASRec.pytorch's loss
    got = sampled_bce_loss(hidden, pos, neg.unsqueeze(2), mask)
    torch.testing.assert_close(got, want)


def test_shift_cuts_one_sequence_into_inputs_and_targets():
    ids = torch.tensor([[4, 7, 1, -1], [3, -1, -1, -1], [5, 6, 2, 8]])
    rows = torch.arange(12.0).view(3, 4, 1)
    inputs, in_mask, targets, target_ids, train = shift(rows, ids)
    assert inputs[:, :, 0].tolist() == [[0, 1, 2], [4, 5, 6], [8, 9, 10]]
    assert targets[:, :, 0].tolist() == [[1, 2, 3], [5, 6, 7], [9, 10, 11]]
    assert target_ids.tolist() == [[7, 1, -1], [-1, -1, -1], [6, 2, 8]]
    assert in_mask.tolist() == [[True, True, True], [True, False, False], [True] * 3]
    assert train.tolist() == [[True, True, False], [False] * 3, [True] * 3]


def test_last_states_reads_each_rows_last_event():
    hidden = torch.arange(24.0).view(3, 4, 2)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert last_states(hidden, mask).tolist() == [[2, 3], [14, 15], [16, 17]]
    mask[1] = False
    with pytest.raises(ValueError, match="row 1 of the batch has an empty history"):
        last_states(hidden, mask)


def softmax_by_hand(hidden, pos, ids, mask, neg, neg_ids, log_q, temperature):  # noqa: ANN001, ANN201
    """The in-batch softmax as a loop: each masked position against every masked position's
    target and the negatives, logQ-corrected, its own item's other copies removed."""
    rows = [(b, i) for b in range(mask.shape[0]) for i in range(mask.shape[1]) if mask[b, i]]
    cands = [(pos[b, i].double(), int(ids[b, i])) for b, i in rows]
    cands += [(neg[m].double(), int(neg_ids[m])) for m in range(neg.shape[0])]
    total = 0.0
    for p, (b, i) in enumerate(rows):
        h = hidden[b, i].double()
        logits = []
        for j, (vec, item) in enumerate(cands):
            if j != p and item == int(ids[b, i]):
                continue  # an accidental hit
            logits.append((j, float(h @ vec) / temperature - float(log_q[item])))
        m = max(v for _, v in logits)
        lse = m + math.log(sum(math.exp(v - m) for _, v in logits))
        total += lse - dict(logits)[p]
    return total / len(rows)


def softmax_case(seed: int = 0):  # noqa: ANN201
    g = torch.Generator().manual_seed(seed)
    b, length, d, items = 3, 4, 5, 7
    ids = torch.randint(0, items, (b, length), generator=g)  # repeats: accidental hits
    mask = torch.rand(b, length, generator=g) > 0.35
    mask[0, 0] = True
    ids[~mask] = -1
    hidden = torch.randn(b, length, d, generator=g)
    table = torch.randn(items, d, generator=g)
    pos = table[ids.clamp(min=0)] * mask.unsqueeze(-1)
    neg_ids = torch.tensor([2, 5, 0])
    log_q = torch.rand(items, generator=g).log()
    return hidden, pos, ids, mask, table[neg_ids], neg_ids, log_q


def test_softmax_by_hand():
    hidden, pos, ids, mask, neg, neg_ids, log_q = softmax_case()
    got = next_item_softmax_loss(hidden, pos, ids, mask, neg, neg_ids, log_q=log_q, temperature=0.5)
    want = softmax_by_hand(hidden, pos, ids, mask, neg, neg_ids, log_q, 0.5)
    assert got.item() == pytest.approx(want, rel=1e-5)
    bare = next_item_softmax_loss(hidden, pos, ids, mask, remove_accidental_hits=False)
    flat = mask.view(-1)
    logits = hidden.view(-1, 5)[flat] @ pos.view(-1, 5)[flat].T
    want = torch.nn.functional.cross_entropy(logits, torch.arange(int(flat.sum())))
    torch.testing.assert_close(bare, want)


def test_padded_rows_of_retrieval_loss_add_nothing_and_are_no_candidate():
    g = torch.Generator().manual_seed(3)
    query, cands = torch.randn(6, 4, generator=g), torch.randn(6 + 2, 4, generator=g)
    items, log_q = torch.tensor([0, 1, 2, 1, 3, 4, 5, 6]), torch.randn(8, generator=g)
    valid = torch.tensor([True, False, True, True, False, True])
    keep = torch.tensor([0, 2, 3, 5, 6, 7])
    args = {"temperature": 0.7, "remove_accidental_hits": True}
    padded = retrieval_loss(query, cands, items, log_q=log_q, valid=valid, **args)
    compact = retrieval_loss(query[valid], cands[keep], items[keep], log_q=log_q[keep], **args)
    torch.testing.assert_close(padded, compact)
    both = retrieval_loss(query, cands, items, log_q=log_q, valid=valid, denominator=8.0, **args)
    torch.testing.assert_close(both, compact * 4 / 8)
    # without valid or denominator: the retrieval task's loss, unchanged
    plain = retrieval_loss(query, cands, items, log_q=log_q, **args)
    every = retrieval_loss(
        query, cands, items, log_q=log_q, valid=torch.ones(6, dtype=bool), **args
    )
    torch.testing.assert_close(plain, every)


def test_softmax_gradients_reach_queries_and_positives():
    hidden, pos, ids, mask, neg, neg_ids, log_q = softmax_case(1)
    hidden.requires_grad_(True)
    pos.requires_grad_(True)
    next_item_softmax_loss(hidden, pos, ids, mask, neg, neg_ids, log_q=log_q).backward()
    assert (hidden.grad[~mask] == 0).all() and (hidden.grad[mask].abs().sum(-1) > 0).all()
    assert (pos.grad[~mask] == 0).all() and (pos.grad[mask].abs().sum(-1) > 0).all()


def test_next_item_objective_log_q_and_negatives():
    windows = np.array([[0, 1, 2, -1], [1, 1, -1, -1], [3, 2, 0, 2]])
    # trained targets: 1, 2 | 1 | 2, 0, 2 -> counts [1, 2, 3, 0], 6 positions in 3 windows
    cfg = RetrievalConfig(temperature=1.0, logq=True, negatives=4)
    obj = next_item_objective(cfg, None, windows, 5, 2, 7, torch.device("cpu"))
    per_batch = 2 * 6 / 3  # positions a batch of 2 windows holds on average
    counts = np.array([1, 2, 3, 1, 1])  # an item never trained on counts once
    want = np.log(per_batch * counts / 6 + 4 / 5)
    np.testing.assert_allclose(obj.log_q.numpy(), want, rtol=1e-6)
    neg = obj.negatives(3)
    assert neg.shape == (4,) and ((neg >= 0) & (neg < 5)).all()
    assert torch.equal(neg, obj.negatives(3))  # seeded by (seed, step)
