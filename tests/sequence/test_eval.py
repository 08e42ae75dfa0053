"""Next-item evaluation (hybridrec.train.next_item_eval) on hand-made scores: the full
catalogue with the input items excluded (in chunks, as a sharded table's parts), the sampled
protocol's draws and ranks, and the metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridrec.data.sequences import LeaveOneOut, sequences_from_table
from hybridrec.train import topk
from hybridrec.train.next_item_eval import (
    RankMetrics,
    catalogue_ranks,
    evaluate_next_item,
    history_codes,
    ranks_among,
    sample_negatives,
)


def small_split(num_items: int = 8) -> LeaveOneOut:
    # user 0: 5, 1, 2, 6 (val 2, test 6); user 1: 3, 0, 4 (val 0, test 4); user 2: 7 only
    users = np.array([0, 0, 0, 0, 1, 1, 1, 2])
    items = np.array([5, 1, 2, 6, 3, 0, 4, 7])
    times = np.arange(8)
    return LeaveOneOut(sequences_from_table(users, items, times, num_items))


def test_rank_metrics_by_hand():
    m = RankMetrics([1, 3], prefix="x_")
    m.add(torch.tensor([0, 2, 5]))
    got = m.result()
    assert got["x_hr@1"] == pytest.approx(1 / 3)
    assert got["x_hr@3"] == pytest.approx(2 / 3)
    assert got["x_ndcg@1"] == pytest.approx(1 / 3)
    assert got["x_ndcg@3"] == pytest.approx((1 + 1 / math.log2(4)) / 3)
    assert set(got) == {"x_hr@1", "x_hr@3", "x_ndcg@1", "x_ndcg@3"}  # no recall
    assert RankMetrics([10]).result() == {}


def test_ranks_among_break_ties_by_lower_item_id():
    scores = torch.tensor([[0.5, 0.9, 0.2, 0.5]])
    items = torch.tensor([[1, 4, 9, 7]])
    # target item 3 at 0.5: 0.9 beats it, item 1 at 0.5 ties and is lower, item 7 is not
    assert ranks_among(torch.tensor([0.5]), torch.tensor([3]), scores, items).item() == 2


def test_catalogue_ranks_exclude_the_input_items_and_agree_over_chunks(monkeypatch):
    # scores of 2 users against 6 items: user q's score of item i is table[q, i]
    table = torch.tensor([[0.1, 0.9, 0.8, 0.3, 0.7, 0.2], [0.5, 0.4, 0.6, 0.1, 0.6, 0.9]])
    states = torch.eye(2)
    vectors = table.T.contiguous()  # [6, 2]: <e_q, vectors[i]> = table[q, i]
    targets = torch.tensor([4, 2])
    seen = torch.tensor([0 * 6 + 1, 1 * 6 + 5])  # user 0 had item 1, user 1 item 5
    # user 0: 1 excluded; 2 (0.8) beats 4 (0.7): rank 1. user 1: 5 excluded; item 4 ties
    # item 2 at 0.6 but 2 is the lower id: rank 0
    assert catalogue_ranks(states, vectors, targets, seen, 3).tolist() == [1, 0]
    assert catalogue_ranks(states, vectors, targets, seen, 1).tolist() == [1, 0]  # 1 = k: a miss
    monkeypatch.setattr(topk, "ITEM_CHUNK_SCORES", 4)  # chunks of 2 items for 2 queries
    assert catalogue_ranks(states, vectors, targets, seen, 3).tolist() == [1, 0]
    # a held-out item that is also an input item is excluded with them: a miss (rank k)
    seen = torch.tensor([0 * 6 + 4, 1 * 6 + 5])
    assert catalogue_ranks(states, vectors, targets, seen, 3).tolist() == [3, 0]


def test_history_codes_are_every_input_item():
    split = small_split()
    test = split.eval_split("test", 2)
    codes = history_codes(test, split.seqs, np.array([1, 0]))
    # position 0 is user 1 (inputs 3, 0), position 1 user 0 (5, 1, 2: beyond max_len 2)
    assert codes.tolist() == sorted([0 * 8 + 3, 0 * 8 + 0, 1 * 8 + 5, 1 * 8 + 1, 1 * 8 + 2])


def test_sample_negatives_are_distinct_unseen_seeded_per_user():
    split = small_split(num_items=200)
    users = split.evaluated
    neg = sample_negatives(split.seqs, users, n=100, seed=5)
    assert neg.shape == (2, 100)
    for q, u in enumerate(users):
        assert len(set(neg[q].tolist())) == 100
        assert not set(neg[q].tolist()) & set(split.seqs.of(u).tolist())  # held-out too
    assert (sample_negatives(split.seqs, users, n=100, seed=5) == neg).all()
    assert (sample_negatives(split.seqs, users[1:], n=100, seed=5)[0] == neg[1]).all()
    assert not (sample_negatives(split.seqs, users, n=100, seed=6) == neg).all()
    with pytest.raises(ValueError, match="user 0 interacted with all but 4 of the 8 items"):
        sample_negatives(small_split().seqs, users, n=5)


def test_evaluate_next_item_by_hand():
    split = small_split()
    test = split.eval_split("test", 3)  # user 0: input 5, 1, 2 -> 6; user 1: 3, 0 -> 4
    vectors = torch.tensor([[float(i)] for i in range(8)])  # item i scores i * state

    def states(inputs: torch.Tensor) -> torch.Tensor:
        # a user's state: +1 if its last input is item 2 (user 0), else -1 (user 1)
        last = inputs.gather(1, ((inputs >= 0).sum(1, keepdim=True) - 1)).squeeze(1)
        return torch.where(last == 2, 1.0, -1.0).unsqueeze(1)

    negatives = np.array([[0, 7, 3], [1, 2, 5]])
    got = evaluate_next_item(
        states, vectors, test, split.seqs, negatives, ks=(1, 2), sampled_ks=(1,)
    )
    # full: user 0 (state +1) ranks 7 > 6 (5, 1, 2 excluded): rank 1; user 1 (state -1) ranks
    # by lowest item: 0 and 3 excluded, then 1, 2, 4: rank 2, a miss at K = 2
    assert got["hr@1"] == 0.0 and got["hr@2"] == pytest.approx(0.5)
    assert got["ndcg@2"] == pytest.approx(0.5 / math.log2(3))
    # sampled: user 0: 7 beats 6 -> rank 1; user 1: 1 and 2 beat 4 -> rank 2
    assert got["sampled_hr@1"] == 0.0 and got["sampled_ndcg@1"] == 0.0
    assert got["eval_users"] == 2
    only_sampled = evaluate_next_item(states, vectors, test, split.seqs, negatives, ks=())
    assert set(only_sampled) == {"sampled_hr@10", "sampled_ndcg@10", "eval_users"}
    assert only_sampled["sampled_hr@10"] == 1.0
