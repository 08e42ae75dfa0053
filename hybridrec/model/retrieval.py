"""What a retrieval model is (model.task=retrieval), and the one order top-K lists follow.

A retrieval model (the built-in two_tower with model.task=retrieval, or the user's own class)
scores a user against every item by a dot product of two towers' vectors:

    class MyRetrieval(nn.Module):
        user_feature = "user_id"    # the feature whose id names a user (its seen items)
        item_feature = "movie_id"   # the feature whose ids are the items (the catalogue)
        def forward(self, dense, ids, negatives=None):     # training (through DDP)
            return self.query(dense, ids), self.candidates(candidate_ids(ids, ...))
        def query(self, dense, ids: KeyedIds) -> Tensor        # [b, D]: the user tower
        def candidates(self, item_ids: Tensor) -> Tensor        # [n] ids -> [n, D]: items

`forward` returns (query [b, D], candidates [b + M, D]): row i's positive is candidates[i],
the item of its own row; with `negatives` ([M] item ids, the same on every rank) the M
vectors after them are those items'. The candidates of one step must come from ONE lookup
of the item feature's EmbeddingTables, which holds that feature alone: ids
`candidate_ids(ids, item_feature, negatives)` [b + M, 1] (host caches stage exactly these
ids ahead of the step). `query` and `candidates` are what evaluation and exports call.
Nothing here imports torch.distributed: the loss that gathers the items of every rank is
hybridrec.train.retrieval's.

Top-K order (`order_keys`): by score, higher first; equal scores by item id, lower first.
One int64 key per (score, item) holds both, so `torch.topk` over keys is exact and
deterministic, and top-K lists merged from the parts of a catalogue equal the whole's.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from hybridrec.types import KeyedIds

RETRIEVAL_METHODS = ("query", "candidates")
RETRIEVAL_FEATURES = ("user_feature", "item_feature")
NO_ITEM = torch.iinfo(torch.int64).min  # the key of an excluded item, below every real one
MAX_ITEM_ID = 2**32 - 1


def candidate_ids(
    ids: KeyedIds, item_feature: str, negatives: torch.Tensor | None = None
) -> torch.Tensor:
    """The ids [b + M, 1] a retrieval model's one item lookup of a step reads: the batch's
    item ids, then `negatives` [M] (module docstring)."""
    items = ids.select([item_feature], [1])
    if negatives is None or negatives.numel() == 0:
        return items
    return torch.cat([items, negatives.to(items.device, items.dtype).view(-1, 1)])


def check_retrieval_model(model: nn.Module, features: list[str], name: str) -> tuple[str, str]:
    """(user_feature, item_feature) of a retrieval model; ValueError (one line) for a model
    that lacks the contract (module docstring) or names features the dataset lacks."""
    missing = [m for m in RETRIEVAL_METHODS if not callable(getattr(model, m, None))]
    missing += [a for a in RETRIEVAL_FEATURES if not isinstance(getattr(model, a, None), str)]
    if missing:
        raise ValueError(
            f"{name} is not a retrieval model (model.task=retrieval): it lacks "
            f"{', '.join(missing)}; a retrieval model defines query(dense, ids), "
            "candidates(item_ids), user_feature and item_feature (docs/library.md, Retrieval)"
        )
    user, item = model.user_feature, model.item_feature
    for key, feature in (("user_feature", user), ("item_feature", item)):
        if feature not in features:
            raise ValueError(
                f"{name}: {key}={feature!r} is not a feature of the dataset; its features are "
                f"{features}"
            )
    if "negatives" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"{name}: a retrieval model's forward takes (dense, ids, negatives=None) and returns "
            "(query, candidates) (docs/library.md, Retrieval)"
        )
    return user, item


def order_keys(scores: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """int64 keys of (score, item) pairs, ordered as the top-K lists are: a higher score
    first, then a lower item id. scores: fp32, any shape; items: int64 ids in [0, 2^32)
    broadcasting against it. -0.0 counts as 0.0; a NaN score is refused by the caller."""
    bits = (scores.float() + 0.0).view(torch.int32).long()  # + 0.0: -0.0 becomes +0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: flip magnitude
    return (ordered << 32) | (MAX_ITEM_ID - items)


def decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(items int64, scores fp32) of `order_keys`' keys; item -1 and score -inf for NO_ITEM."""
    items = MAX_ITEM_ID - (keys & MAX_ITEM_ID)
    ordered = (keys >> 32).int()
    bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    scores = bits.view(torch.float32).clone()
    missing = keys == NO_ITEM
    return items.masked_fill(missing, -1), scores.masked_fill(missing, float("-inf"))


def top_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest keys of each row of keys [n, m], in order; rows with fewer than k
    columns are padded with NO_ITEM."""
    if keys.shape[1] < k:
        pad = keys.new_full((keys.shape[0], k - keys.shape[1]), NO_ITEM)
        keys = torch.cat([keys, pad], dim=1)
    return keys.topk(k, dim=1, sorted=True).values
