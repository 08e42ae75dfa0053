"""What travels through one step of the sharded collection, by value, and the exchange contract.

One batch's ids go through the same stages at any world size (hybridrec.sparse.sharded):

    ids --exchange.route--> StepContext(lookups: GroupKey -> GroupInput, receipt)
        --prefetch (host groups, a step ahead)--> StepContext(prefetched=...)
        --dynamic maps (raw ids -> rows)--> StepContext(lookups mapped)
        --one fused lookup per group--> pooled rows per group
        --exchange.deliver--> the batch's embeddings [B_l, T, D] (or [B_l, sum_t D_t])

An `Exchange` is how ids reach their groups and pooled rows come back: the all-to-all over
any number of ranks (hybridrec.sparse.exchange.all_to_all; the identity on one rank), or on
one rank whose one group holds every table whole, the sample-major numbering that needs no
reassembly (hybridrec.sparse.exchange.sample_major). Everything a later stage needs from an
earlier one is a field of the StepContext: nothing is kept on the side, no closure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hybridrec.sparse.host import Prefetched
from hybridrec.sparse.layout import GroupKey
from hybridrec.types import Embedded


@dataclass(frozen=True)
class GroupInput:
    """One fused group's lookup in a step: group rows [N] (slot offset + shard row), bags [N]
    non-decreasing (numbered by the exchange: (source rank, unit, sample) for the all-to-all,
    sample-major on one rank), per-id scale [N] or None, and per source rank the bags (pooled
    rows to send back) that are its samples'. `raw`: slot position -> positions [n] in `rows`
    holding a dynamic table's raw ids, still to be mapped to that slot's rows ({} once
    mapped, or without dynamic tables). `per_unit`: per source rank, the bags of each of the
    group's units, in order (the all-to-all's; None for the sample-major numbering): which
    unit, so which feature, a bag is (exact mode's canonical order, hybridrec.sparse.exact)."""

    rows: torch.Tensor
    bags: torch.Tensor
    scale: torch.Tensor | None
    num_bags: int
    per_rank: list[int]
    raw: dict[int, torch.Tensor] = field(default_factory=dict)
    per_unit: list[list[int]] | None = None


@dataclass(frozen=True)
class Receipt:
    """What the output side needs to put pooled rows back in their samples: per rank q and
    unit of q how many rows come back to this rank (`recv_rows`) and, for compact (row-wise)
    units by position in the received list, which of this rank's samples they are (`kept`)."""

    recv_rows: list[list[int]]
    kept: dict[int, torch.Tensor]


@dataclass(frozen=True)
class Wire:
    """How pooled rows cross the output dist: in `dtype` both ways; `keep`: they stay in it
    on arrival (the hand-off dtype) instead of returning to fp32; `scale`: the backward's
    gradient factor applied in fp32 after its exchange (the hand-off's 1/W, else 1)."""

    dtype: torch.dtype = torch.float32
    keep: bool = False
    scale: float = 1.0


@dataclass(frozen=True)
class StepContext:
    """One batch in the collection's step (see the module docstring).

    ids         [B_l, H] the batch's ids as checked (out-of-range ones read as 0 on several
                ranks, where the check's verdict rode the input dist)
    given       the ids as prefetch() received them, and their tensor version then, for the
                forward's check that it runs on the batch staged (`matches`)
    lookups     each local group's lookup over the global batch (GroupInput)
    receipt     what the output side needs (None: the sample-major exchange needs nothing)
    prefetched  per host group, what its prefetch admitted for exactly these rows
    replicas    the replicated tables' inputs, made by the forward for their backward sync
    row_stats   the step's row statistics of column shards (row-wise Adagrad), filled in
                the output dist's backward and read by the groups' backward after it
    wire        how the output dist carries this step's pooled rows
    """

    ids: torch.Tensor
    lookups: dict[GroupKey, GroupInput]
    receipt: Receipt | None = None
    given: torch.Tensor | None = None
    given_version: int = -1
    prefetched: dict[GroupKey, Prefetched] = field(default_factory=dict)
    replicas: Any = None
    row_stats: Any = None
    wire: Wire = Wire()

    def replace(self, **changes: Any) -> StepContext:
        return dataclasses.replace(self, **changes)

    def matches(self, ids: torch.Tensor) -> bool:
        """Whether `ids` are the values this context was staged for (`given`, the batch's ids
        as prefetch() received them): the same tensor memory, unwritten since, or equal
        values (one comparison)."""
        given = self.given
        if given is None or ids.shape != given.shape:
            return False
        if (
            ids.device == given.device
            and ids.data_ptr() == given.data_ptr()
            and ids.stride() == given.stride()
            and ids._version == self.given_version
        ):
            return True
        return bool(torch.equal(ids.to(given.device), given))


class UnequalBatches(Exception):
    """Raised on every rank alike by a route told to share the ranks' batch sizes, when they
    differ (before any id is exchanged): `sizes`, every rank's B_l, in rank order."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__(f"the ranks' batch sizes differ: {sizes}")
        self.sizes = sizes


class Exchange(Protocol):
    """How a batch's ids reach this rank's groups and their pooled rows come back."""

    def route(
        self, ids: torch.Tensor, flag: bool | None, share_batch: bool = False
    ) -> tuple[StepContext, bool]:
        """ids [B_l, H] (checked; `flag`: this rank found out-of-range ones, now 0; None: a
        deferred check, nothing to share) -> (the step's context with every local group's
        lookup, whether some rank flagged a bad id). `share_batch` (the all-to-all's, where its
        `shares_batch`: its sizes exchange carries them): every rank also learns the others'
        B_l, and all raise UnequalBatches when they differ."""
        ...

    def deliver(self, pooled: dict[GroupKey, torch.Tensor], step: StepContext) -> Embedded:
        """Each group's pooled rows [n_g, w_g] -> this rank's samples' embeddings (Embedded)."""
        ...
