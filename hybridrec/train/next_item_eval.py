"""Next-item evaluation under leave-one-out (hybridrec.data.sequences.LeaveOneOut): each
evaluated user's state after its input sequence ranks the catalogue, and its held-out item's
rank gives the metrics. Two protocols, both averaged over every evaluated user:

Full catalogue (`hr@K`, `ndcg@K` for each K of `ks`): every item row of the item table is
scored; the items of the user's input events (all of them, not only the most recent max_len:
train for val, train + val for test) are excluded; the held-out item's rank r (from 0) among
the rest, ordered as the retrieval top-K lists are (hybridrec.model.retrieval.order_keys:
higher score first, equal scores by lower item id), gives HR@K = [r < K] and NDCG@K =
[r < K] / log2(r + 2). Exact: the top-K runs over catalogue chunks of bounded memory
(hybridrec.train.topk.chunked_top_keys, the retrieval task's), so a sharded item table's
parts can be ranked apart and their top-K merged (hybridrec.model.retrieval.top_keys). A
held-out item that is also an input item (a repeat) is excluded with them, and so a miss
(the retrieval task's rule; Amazon Games has no repeats).

Sampled (`sampled_hr@K`, `sampled_ndcg@K`), the SASRec paper's protocol: the held-out item
ranked against 100 items the user never interacted with (`sample_negatives`), in the same
order and with the same formulas. Exactly: for user index u, a generator
numpy.random.default_rng([seed, u]) draws batches of n integers uniform in [0, num_items); a
draw is accepted when it is not in u's whole sequence (train, val and test, so the held-out
item is never a negative) and not accepted before, in draw order, until n are: n distinct
items uniform over the items u never had. The draws depend on the seed and the user alone,
so val and test rank against the same items, and a run on any number of ranks draws the
same. (The paper's code draws with replacement and avoids only the train items; the issue
asks for items the user never interacted with.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from hybridrec.data.sequences import EvalSplit, Sequences
from hybridrec.model.retrieval import decode_keys, order_keys
from hybridrec.train.metrics import TopKMetrics
from hybridrec.train.topk import chunked_top_keys, seen_mask

SAMPLED = 100  # the published protocol's negatives per user


def sample_negatives(
    seqs: Sequences, users: np.ndarray, n: int = SAMPLED, seed: int = 0
) -> np.ndarray:
    """[Q, n] int64: for each user index of `users` [Q], n distinct item rows it never
    interacted with, drawn as the module docstring says. ValueError when a user has fewer
    than n such items."""
    out = np.empty((len(users), n), dtype=np.int64)
    for q, u in enumerate(users):
        history = seqs.of(int(u))
        free = seqs.num_items - len(np.unique(history))
        if free < n:
            raise ValueError(
                f"sampled evaluation: user {seqs.users[u]} interacted with all but {free} of "
                f"the {seqs.num_items} items; {n} negatives need at least {n} others"
            )
        rng = np.random.default_rng([seed, int(u)])
        taken: list[int] = []
        seen = set(history.tolist())
        while len(taken) < n:
            for item in rng.integers(0, seqs.num_items, size=n).tolist():
                if item not in seen:
                    seen.add(item)
                    taken.append(item)
                    if len(taken) == n:
                        break
        out[q] = taken
    return out


def ranks_among(
    target_scores: torch.Tensor,
    targets: torch.Tensor,
    scores: torch.Tensor,
    items: torch.Tensor,
) -> torch.Tensor:
    """[Q] int64: how many of each row's other items (scores [Q, n] of items [Q, n]) come
    before its target (target_scores [Q] of targets [Q]) in the top-K order."""
    target = order_keys(target_scores.unsqueeze(1), targets.unsqueeze(1))
    return (order_keys(scores, items) > target).sum(1)


class RankMetrics:
    """Running HR@K and NDCG@K over users from each held-out item's rank (from 0), keyed
    `{prefix}hr@K` and `{prefix}ndcg@K`: the retrieval task's TopKMetrics with one positive
    per user (where Recall@K = HR@K, left out)."""

    def __init__(self, ks: Sequence[int], prefix: str = "") -> None:
        self.metrics, self.prefix = TopKMetrics(list(ks)), prefix
        self.k = max(self.metrics.ks)

    @property
    def users(self) -> int:
        return self.metrics.users

    def add(self, ranks: torch.Tensor) -> None:
        """ranks [Q] int64 (any rank >= max K: a miss)."""
        hits = torch.arange(self.k) == ranks.cpu().unsqueeze(1)
        self.metrics.add(hits, torch.ones(ranks.shape[0], dtype=torch.int64))

    def result(self) -> dict[str, float]:
        """The means over the users added ({} when none)."""
        out = self.metrics.result()
        return {f"{self.prefix}{k}": v for k, v in out.items() if not k.startswith("recall")}


def history_codes(split: EvalSplit, seqs: Sequences, rows: np.ndarray) -> torch.Tensor:
    """Sorted int64 codes q * num_items + item of the input items of `split`'s users at
    positions `rows` [Q] (q from 0 within them): what a full-catalogue ranking excludes."""
    users = split.users[rows]
    starts, ends = seqs.offsets[users], split.history_ends[rows]
    counts = ends - starts
    q = np.repeat(np.arange(len(users)), counts)
    at = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    items = seqs.items[np.repeat(starts, counts) + at]
    return torch.from_numpy(np.unique(q * seqs.num_items + items))


def catalogue_ranks(
    states: torch.Tensor,
    item_vectors: torch.Tensor,
    targets: torch.Tensor,
    seen: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """[Q] int64: each held-out item's exact rank over the whole catalogue (item_vectors
    [N, D], row r = item r), the input items (`seen`: history_codes) excluded; states [Q, D]
    the users' states. Only the top k are ranked: a target past them gets rank k."""
    n = item_vectors.shape[0]
    ids = torch.arange(n, device=item_vectors.device)
    users = torch.arange(states.shape[0])

    def excluded(a: int, b: int) -> torch.Tensor:
        return seen_mask(seen, users, n, a, b).to(states.device)

    keys = chunked_top_keys(states, item_vectors, ids, excluded, k)
    items, _ = decode_keys(keys.cpu())
    hit = items == targets.cpu().unsqueeze(1)
    return torch.where(hit.any(1), hit.int().argmax(1), torch.full_like(targets.cpu(), k))


@torch.no_grad()
def evaluate_next_item(
    user_states: Callable[[torch.Tensor], torch.Tensor],
    item_vectors: torch.Tensor,
    split: EvalSplit,
    seqs: Sequences,
    negatives: np.ndarray | None,
    ks: Sequence[int] = (10, 50),
    sampled_ks: Sequence[int] = (10,),
    batch: int = 1024,
) -> dict[str, float]:
    """Both protocols (module docstring) in one process: user_states(inputs [Q, L] int64,
    PAD -1) -> [Q, D] each user's state after its last input event; item_vectors [N, D] the
    catalogue's scoring vectors; negatives [Q, 100] (sample_negatives of split.users) or None
    to skip the sampled protocol. Returns hr@K and ndcg@K for each K of `ks` (empty: no
    full-catalogue ranking), sampled_hr@K and sampled_ndcg@K for each of `sampled_ks`, and
    eval_users."""
    full = RankMetrics(ks) if ks else None
    sampled = RankMetrics(sampled_ks, "sampled_") if negatives is not None else None
    device = item_vectors.device
    vectors = item_vectors.float()
    # users by input length, each batch as wide as its longest input: trailing PAD changes
    # no encoder output, so this only skips work
    lengths = (split.inputs >= 0).sum(1)
    order = np.argsort(lengths, kind="stable")
    for a in range(0, len(order), batch):
        rows = order[a : a + batch]
        width = max(int(lengths[rows].max()), 1)
        inputs = torch.from_numpy(split.inputs[rows, :width]).to(device)
        targets = torch.from_numpy(split.targets[rows]).to(device)
        states = user_states(inputs).float()
        if not bool(torch.isfinite(states).all()):
            raise ValueError("next-item evaluation: NaN or inf user states (a diverged model)")
        if full is not None:
            seen = history_codes(split, seqs, rows)
            full.add(catalogue_ranks(states, vectors, targets, seen, full.k))
        if sampled is not None:
            neg = torch.from_numpy(negatives[rows]).to(device)
            neg_scores = torch.einsum("qd,qnd->qn", states, vectors[neg])
            target_scores = (states * vectors[targets]).sum(1)
            sampled.add(ranks_among(target_scores, targets, neg_scores, neg))
    out = {"eval_users": float(len(split.users))}
    for part in (full, sampled):
        out.update(part.result() if part is not None else {})
    return out
