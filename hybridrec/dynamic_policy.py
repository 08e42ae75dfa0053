"""A dynamic table's policy (`Dynamic`): its one definition and its one validation.

Torch-free on purpose (it imports nothing but the standard library): the library
(hybridrec.types re-exports `Dynamic`, hybridrec.model.tables' `Table(dynamic=...)`), the
dataset spec (hybridrec.data.spec, which preprocessing reads without torch) and the config
checks (hybridrec.config.dynamic) all build a `Dynamic` to check a policy, so the three
cannot disagree on its keys, types, choices or ranges.

A bad value raises `PolicyError`, a ValueError that carries the key it is about (`key`) and
what is wrong with it (`problem`), so each caller names the key in its own terms
(`model.dynamic.<table>.<key>`, `sparse[i] (name).policy.<key>`) without reading the message
back. Types are checked (an int is no bool; a probability is a finite number), so a policy
read from YAML or a command line fails in one line naming the key, never with a TypeError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

# A dynamic table's choices (Dynamic): how a new id gets a row, which row a full bucket frees,
# and what an id without a row looks up at evaluation and inference
DYNAMIC_ADMIT = ("always", "count", "probability")
DYNAMIC_EVICT = ("lfu", "lru", "ttl")
DYNAMIC_UNKNOWN = ("zeros", "row")

# Use counts halve every this many lookups: host caches' (sharding.cache_halflife) and dynamic
# tables' LFU (Dynamic.halflife). 1000, not 100: replayed on the CPU
# (benchmarks/results/cache_policy_halflife_*.md), a short memory let rows met once push out
# rows of steady popularity
CACHE_HALFLIFE = 1000


class PolicyError(ValueError):
    """A bad dynamic-table policy: `key` (a Dynamic field, or the unknown key given) and
    `problem`, what is wrong with its value ("must be int, got '3'", "='fifo' is not one of:
    lfu, lru, ttl"). `detail` joins them ("min_count must be int, got '3'") for a caller to
    put after its own name of the policy; str() is "dynamic table: <detail>"."""

    def __init__(self, key: str, problem: str) -> None:
        self.key, self.problem = key, problem
        super().__init__(f"dynamic table: {self.detail}")

    @property
    def detail(self) -> str:
        sep = "" if self.problem.startswith("=") else " "
        return f"{self.key}{sep}{self.problem}"


@dataclass(frozen=True)
class Dynamic:
    """A dynamic table's policy: its ids are raw int64 values from an open set (no
    vocabulary), mapped while training to the table's `num_rows` slots.

    The slots are split into `buckets` fixed hash buckets (independent of the world size: an
    id's bucket is a hash of the id, and a shard owns whole buckets), each with its own map and
    policy, so every decision depends only on the ids of its bucket: the same at any world size.
    `admit`: "always"; "count", once an id was seen `min_count` times; "probability", each
    new id with `probability` (decided by a hash of the id, so deterministically).
    `evict`, when a bucket is full: "lfu" (use counts halving every `halflife` steps, as the
    host cache's), "lru", or "ttl" (an id unused for `ttl_steps` steps frees its row).
    A readmitted id starts from fresh rows and optimizer state. `unknown`: what an id without
    a row looks up at evaluation and inference: "zeros", or "row" (one shared trained row).

    Raises PolicyError (naming the key) for a value of the wrong type or out of range.
    """

    admit: str = "always"
    min_count: int = 1
    probability: float = 1.0
    evict: str = "lfu"
    ttl_steps: int = 0
    halflife: int = CACHE_HALFLIFE
    unknown: str = "zeros"
    buckets: int = 64

    def __post_init__(self) -> None:
        _choice("admit", self.admit, DYNAMIC_ADMIT)
        _integer("min_count", self.min_count, 1)
        p = self.probability
        if isinstance(p, bool) or not isinstance(p, (int, float)):
            raise PolicyError("probability", f"must be a number, got {p!r}")
        if not (math.isfinite(p) and 0.0 < p <= 1.0):
            raise PolicyError("probability", f"must be in (0, 1], got {p!r}")
        object.__setattr__(self, "probability", float(p))  # 1 and 1.0: one policy
        _choice("evict", self.evict, DYNAMIC_EVICT)
        _integer("ttl_steps", self.ttl_steps, 0)
        if self.evict == "ttl" and self.ttl_steps < 1:
            raise PolicyError(
                "ttl_steps",
                f"must be >= 1 with evict: ttl (the steps an unused id keeps its row), "
                f"got {self.ttl_steps}",
            )
        _integer("halflife", self.halflife, 1)
        _choice("unknown", self.unknown, DYNAMIC_UNKNOWN)
        _integer("buckets", self.buckets, 1)

    @property
    def reserved_rows(self) -> int:
        """Rows of each bucket no id takes: its shared unknown row under unknown="row" (the
        bucket's last row), else none."""
        return 1 if self.unknown == "row" else 0

    def unknown_row(self, bucket, rows_per_bucket: int):  # noqa: ANN001, ANN201 (int or tensor)
        """The row an id of `bucket` (an int or an int64 tensor, counted from the first bucket
        of the rows in question) without a row of its own looks up under unknown="row": its
        bucket's last row. The one statement of that rule (hybridrec.sparse.dynamic.idmap)."""
        return bucket * rows_per_bucket + (rows_per_bucket - 1)

    def fits(self, num_rows: int) -> bool:
        """Whether a table of `num_rows` rows splits into these buckets, each with a row for
        an id besides its reserved rows."""
        return num_rows % self.buckets == 0 and num_rows // self.buckets > self.reserved_rows


# the policy's keys, in declaration order (what model.dynamic.<table> and a spec's policy take)
POLICY_KEYS = tuple(f.name for f in fields(Dynamic))


def policy_of(given: dict) -> Dynamic:
    """The Dynamic of a mapping of policy keys (keys left out take Dynamic's defaults);
    PolicyError naming the first key that is not a policy key or has a bad value."""
    unknown = [k for k in given if k not in POLICY_KEYS]
    if unknown:
        raise PolicyError(str(unknown[0]), f"is not a policy key; keys: {', '.join(POLICY_KEYS)}")
    return Dynamic(**given)


def _choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str):
        raise PolicyError(key, f"must be str (one of: {', '.join(choices)}), got {value!r}")
    if value not in choices:
        raise PolicyError(key, f"={value!r} is not one of: {', '.join(choices)}")


def _integer(key: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolicyError(key, f"must be int, got {value!r}")
    if value < least:
        raise PolicyError(key, f"must be >= {least}, got {value}")
