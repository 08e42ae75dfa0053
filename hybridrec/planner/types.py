"""The planner's value types: the cluster, the optimizer and cache sizing, bytes, errors.

Frozen dataclasses with validation only; no planning logic. `Topology` is what a plan is for
(ranks, per-rank device budget, bandwidths), `OptimizerFootprint` what a sparse optimizer
stores per row and per element, from its state kinds (`OPTIMIZER_FOOTPRINTS`: every optimizer
of hybridrec.types.SPARSE_OPTIMIZER_STATE, by name), `CachePolicy` how large a host-resident
shard's device cache is,
`MemoryUse` device bytes by kind, and `PlannerError` a plan that does not fit, with every
rank's need against the budget in its message. Memory is counted in binary units (`GIB`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hybridrec.types import SPARSE_OPTIMIZER_STATE, STATE_BYTES, StateKind

GIB = 1 << 30


@dataclass(frozen=True)
class Topology:
    """The machines the plan is for. Bandwidths in bytes/s, budget in bytes per rank."""

    world_size: int
    hbm_bytes_per_rank: int  # budget for embeddings: weights + optimizer state + exchange buffers
    ranks_per_node: int = 8
    intra_node_bw: float = 300e9  # all-to-all bytes/s per rank inside a node (NVLink-class)
    inter_node_bw: float = 25e9  # bytes/s per rank across nodes (200 Gb/s InfiniBand)
    hbm_bw: float = 2.98e12  # device memory bandwidth (H100 copy)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.hbm_bytes_per_rank <= 0:
            raise ValueError(f"hbm_bytes_per_rank must be > 0, got {self.hbm_bytes_per_rank}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        for name in ("intra_node_bw", "inter_node_bw", "hbm_bw"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


@dataclass(frozen=True)
class OptimizerFootprint:
    """Sparse optimizer state of a shard: rows * (bytes_per_row + width * bytes_per_element)."""

    bytes_per_row: int = 0  # row-wise Adagrad: 4 (one fp32 accumulator per row)
    bytes_per_element: int = 0  # Adam: 8 (two fp32 moments per element), Adagrad: 4; SGD: 0

    @classmethod
    def of_state(cls, kinds: Iterable[StateKind | str]) -> OptimizerFootprint:
        """The footprint of optimizer state of these kinds (one entry per state tensor, as
        the values of a `state_spec()`): STATE_BYTES per row or per element each."""
        kinds = [StateKind(k) for k in kinds]
        return cls(
            bytes_per_row=STATE_BYTES * kinds.count(StateKind.ROW),
            bytes_per_element=STATE_BYTES * kinds.count(StateKind.ELEMENT),
        )

    @classmethod
    def for_optimizer(cls, name: str) -> OptimizerFootprint:
        """The footprint of a sparse optimizer by name: one of OPTIMIZERS."""
        if name not in OPTIMIZER_FOOTPRINTS:
            raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(OPTIMIZERS)}")
        return OPTIMIZER_FOOTPRINTS[name]

    def bytes_for(self, rows: int, width: int) -> int:
        return rows * (self.bytes_per_row + width * self.bytes_per_element)


# The sparse optimizers the planner can size, by name (the order of the CLI's choices),
# each from the kinds of the state it keeps
OPTIMIZER_FOOTPRINTS: dict[str, OptimizerFootprint] = {
    name: OptimizerFootprint.of_state(state.values())
    for name, state in SPARSE_OPTIMIZER_STATE.items()
}
OPTIMIZERS = tuple(OPTIMIZER_FOOTPRINTS)
NO_OPTIMIZER_STATE = OptimizerFootprint()  # plain SGD: the default everywhere


class PlannerError(ValueError):
    """A plan that does not fit, with every rank's need against the budget (in the message).

    `needs` holds each rank's bytes (what it would need), `budget` the per-rank budget.
    """

    def __init__(self, headline: str, needs: Sequence[int], budget: int, hint: str = "") -> None:
        self.headline = headline
        self.needs = tuple(int(n) for n in needs)
        self.budget = int(budget)
        self.hint = hint
        lines = [headline]
        for rank, need in enumerate(self.needs):
            over = "  OVER" if need > budget else ""
            lines.append(
                f"  rank {rank}: needs {human_bytes(need)} ({need:,} bytes)"
                f" of budget {human_bytes(budget)} ({budget:,} bytes){over}"
            )
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))

    def __reduce__(self):  # keep it picklable (it crosses process boundaries in launchers)
        return (PlannerError, (self.headline, self.needs, self.budget, self.hint))


@dataclass(frozen=True)
class MemoryUse:
    """Bytes one rank (or one shard) needs, by kind."""

    weights: int = 0
    optimizer: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.buffers

    def __add__(self, other: MemoryUse) -> MemoryUse:
        return MemoryUse(
            self.weights + other.weights,
            self.optimizer + other.optimizer,
            self.buffers + other.buffers,
        )


@dataclass(frozen=True)
class CachePolicy:
    """Size of the device cache of a host-resident shard (config: sharding.cache_*).

    Each shard caches `fraction` of its rows, or, when `gb` is set, every host-resident
    shard of a rank caches the same fraction, chosen so the rank's caches (rows, optimizer
    state, bookkeeping) take `gb` GiB. Either way a cache holds at least `min_batches`
    batches' ids (so one step's rows, and the next step's prefetched ones, always fit) and
    at most the whole shard.
    """

    fraction: float = 0.05
    gb: float | None = None
    min_batches: int = 2

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"cache fraction must be in (0, 1], got {self.fraction}")
        if self.gb is not None and self.gb <= 0:
            raise ValueError(f"cache size in GB must be > 0, got {self.gb}")
        if self.min_batches < 1:
            raise ValueError(f"cache min_batches must be >= 1, got {self.min_batches}")

    def rows(self, shard_rows: int, ids_per_step: int, fraction: float | None = None) -> int:
        """Cache rows for a shard of `shard_rows` rows that receives `ids_per_step` ids."""
        floor = min(shard_rows, self.min_batches * ids_per_step)
        return max(1, min(shard_rows, max(self.asked(shard_rows, fraction), floor)))

    def asked(self, shard_rows: int, fraction: float | None = None) -> int:
        """The rows `fraction` (default: self.fraction) asks for, before the floor."""
        want = math.ceil((self.fraction if fraction is None else fraction) * shard_rows)
        return max(1, min(shard_rows, want))


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as memory is counted)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
