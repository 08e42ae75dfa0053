"""Next-item evaluation under leave-one-out (hybridrec.data.sequences.LeaveOneOut): each
evaluated user's state after its input sequence ranks the catalogue, and its held-out item's
rank gives the metrics. Two protocols, both averaged over every evaluated user:

Full catalogue (`hr@K`, `ndcg@K` for each K of `ks`): every item row of the item table is
scored; the items of the user's input events (all of them, not only the most recent max_len:
train for val, train + val for test) are excluded; the held-out item's rank r (from 0) among
the rest, ordered as the retrieval top-K lists are (hybridrec.model.retrieval.order_keys:
higher score first, equal scores by lower item id), gives HR@K = [r < K] and NDCG@K =
[r < K] / log2(r + 2). Exact: the top-K runs over catalogue chunks of bounded memory
by counting, per catalogue chunk, the items ordered before the held-out one (`catalogue_ranks`),
so memory stays bounded and no top-K list is built. A
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
from hybridrec.model.retrieval import order_keys
from hybridrec.train.metrics import TopKMetrics

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
    chunk: int = 1 << 16,
) -> torch.Tensor:
    """[Q] int64: each held-out item's exact rank over the whole catalogue (item_vectors
    [N, D], row r = item r), the input items (`seen`: history_codes) excluded (a held-out
    item among them with them: rank k, a miss); states [Q, D] the users' states. A rank >= k
    is returned as k (a miss at every K <= k). The rank counts
    the items ordered before the target (higher score, or an equal score and a lower id:
    order_keys' order) in one pass per chunk of `chunk` items; the target's score is its own
    entry of the same product, so it is compared with the others bit for bit."""
    n, q = item_vectors.shape[0], states.shape[0]
    device = states.device
    seen = seen.to(device)
    seen_q, seen_item = seen.div(n, rounding_mode="floor"), seen.remainder(n)
    ranks = torch.zeros(q, dtype=torch.int64, device=device)
    target_score = torch.empty(q, device=device)
    for a in range(0, n, chunk):  # the target's entry of the product
        b = min(a + chunk, n)
        inside = (targets >= a) & (targets < b)
        if bool(inside.any()):
            scores = states @ item_vectors[a:b].T
            at = inside.nonzero().squeeze(1)
            target_score[at] = scores[at, targets[at] - a]
    t = target_score.unsqueeze(1)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        scores = states @ item_vectors[a:b].T
        ids = torch.arange(a, b, device=device)
        before = (scores > t) | ((scores == t) & (ids < targets.unsqueeze(1)))
        ranks += before.sum(1)
        # the input items ordered before the target are not ranked: take them back out
        s = (seen_item >= a) & (seen_item < b)
        sq, si = seen_q[s], seen_item[s]
        sc, ts = scores[sq, si - a], target_score[sq]
        out = (sc > ts) | ((sc == ts) & (si < targets[sq]))
        ranks.index_add_(0, sq, -out.long())
    ranks[seen_q[seen_item == targets[seen_q]]] = k  # a repeat: excluded with the inputs, a miss
    return ranks.clamp(max=k).cpu()


def sampled_ranks(
    states: torch.Tensor, item_vectors: torch.Tensor, targets: torch.Tensor, negatives: torch.Tensor
) -> torch.Tensor:
    """[Q] int64: each held-out item's rank among its negatives [Q, n] (the sampled
    protocol), every score from one product, ties to the lower item id."""
    candidates = torch.cat([targets.unsqueeze(1), negatives], 1)
    scores = torch.einsum("qd,qnd->qn", states, item_vectors[candidates])
    return ranks_among(scores[:, 0], targets, scores[:, 1:], negatives).cpu()


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
            sampled.add(sampled_ranks(states, vectors, targets, neg))
    out = {"eval_users": float(len(split.users))}
    for part in (full, sampled):
        out.update(part.result() if part is not None else {})
    return out


EVAL_USERS = 128  # users per lookup in the trainer's evaluation, whatever the world size


class NextItemEvaluation:
    """The trainer's next-item evaluation of a split (val or test) of data=sequences, the same
    figures at any world size: every rank looks the whole catalogue's vectors up
    (`candidates`, in chunks, the same ids on every rank: collective lookups of a sharded
    item table); the evaluated users go in batches of EVAL_USERS (the last padded), batch i
    to rank i mod W, every rank taking as many (padded with copies); each batch's held-out
    items are ranked both ways (module docstring), and the ranks' per-user results are
    gathered in user order. A batch's figures do not depend on which rank computed them.
    `model`: the unwrapped model (query, candidates, max_len, per_position); `source`: the
    SequenceSource."""

    def __init__(self, model, source, env, ks: Sequence[int], seed: int) -> None:  # noqa: ANN001
        self.model, self.source, self.env = model, source, env
        self.ks, self.seed = list(ks), seed
        self._negatives: dict[str, np.ndarray] = {}

    def negatives(self, split: str) -> np.ndarray:
        """[Q, 100] the split's sampled negatives (drawn once: the same every evaluation)."""
        if split not in self._negatives:
            users = self.source.eval_split(split).users
            self._negatives[split] = sample_negatives(self.source.seqs, users, seed=self.seed)
        return self._negatives[split]

    def item_vectors(self, chunk: int) -> torch.Tensor:
        """[N, D]: every item's scoring vector."""
        n, device = self.source.num_items, self.env.device
        parts = [
            self.model.candidates(torch.arange(a, min(a + chunk, n), device=device)).float()
            for a in range(0, n, chunk)
        ]
        return torch.cat(parts)

    @torch.no_grad()
    def __call__(
        self,
        split: str,
        keyed: Callable[[torch.Tensor], object],
        max_users: int | None = None,
        chunk: int = 8192,
    ) -> dict[str, float]:
        """hr@K and ndcg@K (eval.topk), sampled_hr@10 and sampled_ndcg@10 over the split's
        first `max_users` evaluated users (None: all)."""
        full, sampled = self.ranks(split, keyed, max_users, chunk)
        result = {"eval_samples": float(len(full)), "catalogue": float(self.source.num_items)}
        for ranks, metrics in (
            (full, RankMetrics(self.ks)),
            (sampled, RankMetrics([10], "sampled_")),
        ):
            metrics.add(ranks)
            result.update(metrics.result())
        return result

    @torch.no_grad()
    def ranks(
        self,
        split: str,
        keyed: Callable[[torch.Tensor], object],
        max_users: int | None = None,
        chunk: int = 8192,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(full [Q], sampled [Q]) int64: each of the split's first `max_users` evaluated
        users' held-out item rank (from 0), in user order, over the whole catalogue (capped
        at max(eval.topk): a miss) and among its sampled negatives (class docstring), the
        same on every rank. Collective."""
        from hybridrec.distributed.comm import all_gather_rows

        ev, seqs = self.source.eval_split(split), self.source.seqs
        total = len(ev.users) if max_users is None else min(max_users, len(ev.users))
        world, rank, device = self.env.world_size, self.env.rank, self.env.device
        batches = -(-total // EVAL_USERS)
        mine = list(range(rank, batches, world))
        rounds = -(-batches // world)
        vectors = self.item_vectors(chunk)
        negatives, k = self.negatives(split), max(self.ks)
        width = self.model.max_len * (1 + self.model.per_position) + 1
        out = torch.full((rounds, 2, EVAL_USERS), -1, dtype=torch.int64)
        for r in range(rounds):  # every rank: the same number of lookups
            i = mine[r] if r < len(mine) else mine[0] if mine else 0
            rows = np.arange(i * EVAL_USERS, (i + 1) * EVAL_USERS)
            real = rows < total
            rows = np.where(real, rows, 0)  # padding: copies of the first user
            ids = np.full((EVAL_USERS, width), -1, dtype=np.int64)
            ids[:, : self.model.max_len] = ev.inputs[rows]
            states = self.model.query(torch.zeros(EVAL_USERS, 0, device=device),
                                      keyed(torch.from_numpy(ids).to(device))).float()  # fmt: skip
            if r >= len(mine):
                continue  # a copy, for the lookups' sake
            if not bool(torch.isfinite(states).all()):
                raise ValueError("next-item evaluation: NaN or inf user states (a diverged model)")
            targets = torch.from_numpy(ev.targets[rows]).to(device)
            seen = history_codes(ev, seqs, rows)
            full = catalogue_ranks(states, vectors, targets, seen, k)
            neg = torch.from_numpy(negatives[rows]).to(device)
            sampled = sampled_ranks(states, vectors, targets, neg)
            out[r] = torch.stack(
                [torch.where(torch.from_numpy(real), x, -1) for x in (full, sampled)]
            )
        every = all_gather_rows(out.to(device), self.env.group, name="next_item_eval").cpu()
        # [W * rounds, 2, EVAL_USERS] in (rank, round) order -> batch order i = round * W + rank
        every = every.view(world, rounds, 2, EVAL_USERS).transpose(0, 1).reshape(-1, 2, EVAL_USERS)
        full, sampled = (every[:, j].reshape(-1) for j in (0, 1))
        return full[full >= 0][:total], sampled[sampled >= 0][:total]
