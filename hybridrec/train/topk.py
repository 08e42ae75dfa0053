"""Exact full-catalogue top-K evaluation of a retrieval model, with the item side sharded.

Queries: each user of the evaluated split, once (its first row gives its features); its
positives: every item of its rows in that split; excluded from its ranking: the items of its
rows in the earlier splits (train for val, train and val for test: Interactions.earlier).
Every trained item of the declared catalogue (Interactions.ranked: train.retrieval.catalogue
less the items the train split never names, whose rows are untrained) is scored; a positive
outside them counts as a miss. The metrics rows carry `catalogue_items` (the declared
catalogue's size) and `catalogue_untrained` (its items never ranked).

How it runs on W ranks, all ranks doing the same collectives in the same order:
1. The catalogue is split in W equal parts (the last padded); each rank computes its part's
   item vectors (`candidates`, the item table's lookups exchanged as in training, in calls of
   `lookup` items) and keeps them: [N/W, D] per rank.
2. Each rank keeps the seen pairs (user, item) whose item is in its part.
3. Per global eval batch: each rank computes its slice's query vectors, all ranks gather them
   (eval batch x D); each rank scores the batch's queries against its part in chunks of items
   (bounded memory: queries x `item_chunk` scores), excludes padding and seen items, and keeps
   a running top-K of int64 keys (hybridrec.model.retrieval.order_keys: higher score first,
   ties by lower item id); the ranks' top-K are gathered and merged into each query's exact
   global top-K, the same on every rank.
4. Hits against the positives give HR@K, Recall@K and NDCG@K (hybridrec.train.metrics).
Equal to one process at any world size: the catalogue order and the tie rule fix every list;
scores agree to float32 round-off (a matmul over other shapes), as training does.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from hybridrec.config.schema import EvalConfig
from hybridrec.data.interactions import Interactions
from hybridrec.distributed.comm import all_gather_rows, any_rank
from hybridrec.distributed.env import DistEnv
from hybridrec.model.retrieval import NO_ITEM, decode_keys, order_keys, top_keys
from hybridrec.train.metrics import TopKMetrics
from hybridrec.types import Batch, KeyedIds

log = logging.getLogger("hybridrec")

ITEM_CHUNK_SCORES = 1 << 24  # scores held at once per chunk: queries x items
MAX_CODE = 2**62  # user id x item rows must stay below it (int64 pair codes)


@dataclass
class TopKLists:
    """Each evaluated user's top-K: users [Q] (user ids, in the split's order of first
    appearance), items [Q, K] (item ids, best first; -1 past the catalogue) and scores
    [Q, K] (fp32)."""

    users: torch.Tensor
    items: torch.Tensor
    scores: torch.Tensor


def _codes(users: np.ndarray, items: np.ndarray, width: int) -> np.ndarray:
    return users.astype(np.int64) * width + items.astype(np.int64)


def seen_mask(seen: torch.Tensor, users: torch.Tensor, width: int, a: int, b: int) -> torch.Tensor:
    """[Q, b - a] bool: whether `seen` (sorted int64 codes user * width + position) holds
    (users[q], p) for each position p in [a, b); users [Q] int64, on the CPU."""
    mask = torch.zeros(users.shape[0], b - a, dtype=torch.bool)
    if not seen.numel() or not users.numel():
        return mask
    lo = torch.searchsorted(seen, users * width + a)
    hi = torch.searchsorted(seen, users * width + b)
    counts = hi - lo
    rows = torch.repeat_interleave(torch.arange(users.shape[0]), counts)
    start = torch.repeat_interleave(lo - counts.cumsum(0) + counts, counts)
    at = seen[start + torch.arange(int(counts.sum()))] - users[rows] * width - a
    mask[rows, at] = True
    return mask


def chunked_top_keys(
    queries: torch.Tensor,
    vectors: torch.Tensor,
    ids: torch.Tensor,
    excluded: Callable[[int, int], torch.Tensor],
    k: int,
) -> torch.Tensor:
    """The top-k keys [Q, k] (hybridrec.model.retrieval.order_keys) of queries [Q, D] against
    items vectors [N, D] with ids [N], scored in chunks of ITEM_CHUNK_SCORES / Q items
    (bounded memory); excluded(a, b) -> [Q, b - a] bool drops pairs with the items at
    [a, b). Fewer than k items left: NO_ITEM fills the rest."""
    step = max(1, ITEM_CHUNK_SCORES // max(1, queries.shape[0]))
    best = torch.full((queries.shape[0], 0), NO_ITEM, dtype=torch.int64, device=queries.device)
    for a in range(0, vectors.shape[0], step):
        b = min(a + step, vectors.shape[0])
        scores = queries @ vectors[a:b].T
        keys = order_keys(scores, ids[a:b])
        best = top_keys(torch.cat([best, keys.masked_fill(excluded(a, b), NO_ITEM)], dim=1), k)
    return best


class CatalogueEval:
    """One evaluation of retrieval model `model` (query, candidates: not wrapped in DDP)
    over dataset split `split` (val or test); `user_rows`: the user table's rows."""

    def __init__(
        self,
        model: torch.nn.Module,
        pairs: Interactions,
        split: str,
        env: DistEnv,
        user_rows: int,
        lookup: int | None = None,
    ) -> None:
        self.model, self.pairs, self.split, self.env = model, pairs, split, env
        self.lookup = lookup or 8192
        catalogue = pairs.ranked()
        self.catalogue = catalogue
        self.sizes = {
            "catalogue_items": len(pairs.catalogue()),
            "catalogue_untrained": len(pairs.catalogue()) - len(catalogue),
        }
        if not len(catalogue):
            raise ValueError(
                "retrieval evaluation: no item of the catalogue is named by the train split, so "
                f"none has a trained row to rank ({pairs.describe()})"
            )
        n, world = len(catalogue), env.world_size
        if user_rows * max(pairs.item_rows, n) >= MAX_CODE:
            raise ValueError(
                f"retrieval evaluation: {user_rows} users x {pairs.item_rows} items do not fit "
                "int64 pair codes"
            )
        self.part = -(-n // world)
        lo = min(env.rank * self.part, n)
        hi = min(lo + self.part, n)
        ids = np.full(self.part, catalogue[0], dtype=np.int64)  # padding: a real item, masked
        ids[: hi - lo] = catalogue[lo:hi]
        self.part_ids = torch.from_numpy(ids).to(env.device)
        self.part_real = torch.arange(self.part, device=env.device) < hi - lo
        # this rank's seen pairs, as user * part + position in the part, sorted
        seen = []
        for earlier in pairs.earlier(split):
            for chunk in pairs.chunks(earlier):
                at = np.minimum(np.searchsorted(catalogue, chunk[:, 1]), n - 1)
                pos = at - lo
                mine = (pos >= 0) & (pos < hi - lo) & (catalogue[at] == chunk[:, 1])
                seen.append(_codes(chunk[mine, 0], pos[mine], self.part))
        self.seen = torch.from_numpy(np.unique(np.concatenate(seen or [np.empty(0, np.int64)])))
        # the split's users: each user's first row, and its positives (user * item rows + item)
        rows = [c for c in pairs.chunks(split)]
        both = np.concatenate(rows) if rows else np.empty((0, 2), np.int64)
        self.users = both[:, 0]
        _, first = np.unique(self.users, return_index=True)
        self.first = np.zeros(len(self.users), dtype=bool)
        self.first[first] = True
        codes = _codes(both[:, 0], both[:, 1], pairs.item_rows)
        self.positives = torch.from_numpy(np.unique(codes))
        self._users_of, self._counts = np.unique(
            self.positives.numpy() // pairs.item_rows, return_counts=True
        )
        unranked = ~np.isin(both[:, 1], catalogue)
        if unranked.any():
            log.info(
                "%s split: %d of its %d interactions name items that are not ranked (never "
                "in the train split, or outside the catalogue): they count as misses",
                split,
                int(unranked.sum()),
                len(both),
            )

    def positives_of(self, users: torch.Tensor) -> torch.Tensor:
        """How many positives each of `users` [Q] (users of the split) has: [Q] int64."""
        at = np.searchsorted(self._users_of, users.numpy())
        return torch.from_numpy(self._counts[at].astype(np.int64))

    def item_vectors(self, candidates: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """This rank's part of the catalogue through the item tower: [part, D] fp32 (every
        rank makes the same calls: the lookups are collective)."""
        out = [
            candidates(self.part_ids[a : a + self.lookup]).float()
            for a in range(0, self.part, self.lookup)
        ]
        vectors = torch.cat(out)
        bad = not bool(torch.isfinite(vectors[self.part_real]).all())
        if any_rank(bad, self.env.group, self.env.device, "eval_items_finite"):
            raise ValueError(
                "retrieval evaluation: the item tower gives NaN or inf vectors (a diverged "
                "model); lower the learning rates"
            )
        return vectors

    def _seen_mask(self, users: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """[Q, b - a] bool: whether each query user has met each item at part positions
        [a, b)."""
        return seen_mask(self.seen, users, self.part, a, b)

    def rank(self, queries: torch.Tensor, users: torch.Tensor, vectors: torch.Tensor, k: int):  # noqa: ANN201
        """The merged top-k keys [Q, k] of queries [Q, D] of users [Q] (identical on every
        rank: a collective)."""

        def excluded(a: int, b: int) -> torch.Tensor:
            return self._seen_mask(users.cpu(), a, b).to(queries.device) | ~self.part_real[a:b]

        best = chunked_top_keys(queries, vectors, self.part_ids, excluded, k)
        if self.env.group is None:
            return top_keys(best, k)
        everyone = all_gather_rows(best, self.env.group, name="eval_topk")  # [W * Q, k]
        world = self.env.world_size
        merged = everyone.view(world, -1, k).permute(1, 0, 2).reshape(-1, world * k)
        return top_keys(merged, k)


@torch.no_grad()
def evaluate_retrieval(
    run: CatalogueEval,
    loader: Iterator[Batch],
    keyed: Callable[[torch.Tensor], KeyedIds],
    cfg: EvalConfig,
    batches: int | None,
    autocast: torch.autocast,
    check_inputs: Callable[[], None],
    chunk: int | None = None,
    lists: bool = False,
) -> tuple[dict[str, float], TopKLists | None]:
    """HR@K, Recall@K and NDCG@K for each K of `cfg.topk` (module docstring) over the users
    whose first row of the split lies in its first `batches` global batches of
    `cfg.batch_size` (None: all), with `eval_samples` the users counted; with `lists`, also
    every user's top-K. `loader`: this rank's slices of those batches; `chunk`: samples per
    lookup (None: a slice at once)."""
    model, ks, batch_size = run.model, cfg.topk, cfg.batch_size
    env, k = run.env, max(ks)
    world = env.world_size
    local = -(-batch_size // world)
    metrics = TopKMetrics(list(ks))
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with autocast:
            vectors = run.item_vectors(model.candidates)
        for step, batch in enumerate(itertools.islice(loader, batches)):
            batch = batch.to(env.device)
            parts = []
            with autocast:
                for a in range(0, batch.size, chunk or batch.size):
                    b = a + (chunk or batch.size)
                    parts.append(model.query(batch.dense[a:b], keyed(batch.ids[a:b])).float())
            queries = torch.cat(parts)
            if env.group is not None:
                queries = all_gather_rows(queries, env.group, name="eval_queries")
            # gathered row j is sample j of the global batch (rank p's slice at block p,
            # padded to `local`); past the batch or the split's end: padding
            j = torch.arange(world * local)
            j = j[(j < batch_size) & (step * batch_size + j < len(run.users))]
            pos = step * batch_size + j
            take = torch.from_numpy(run.first[pos.numpy()])  # a user's first row: its query
            q = queries[j[take].to(queries.device)]
            if not bool(torch.isfinite(q).all()):
                raise ValueError(
                    "retrieval evaluation: the user tower gives NaN or inf vectors (a diverged "
                    "model); lower the learning rates"
                )
            users = torch.from_numpy(run.users[pos[take].numpy()])
            keys = run.rank(q, users.to(q.device), vectors, k)
            items, scores = decode_keys(keys.cpu())
            width = run.pairs.item_rows
            hits = torch.isin(users[:, None] * width + items, run.positives) & (items >= 0)
            metrics.add(hits, run.positives_of(users))
            if lists:
                kept.append((users, keys.cpu()))
    finally:
        loader.close()  # type: ignore[attr-defined]
    check_inputs()  # no metrics from batches with bad ids
    result = metrics.result()
    if result:
        result["eval_samples"] = metrics.users
        result.update(run.sizes)
    out = None
    if lists:
        users = torch.cat([u for u, _ in kept]) if kept else torch.empty(0, dtype=torch.long)
        keys = torch.cat([c for _, c in kept]) if kept else torch.empty(0, k, dtype=torch.long)
        items, scores = decode_keys(keys)
        out = TopKLists(users, items, scores)
    return result, out
