"""model.dynamic: which tables are dynamic and their policies, checked one key at a time.

`model.dynamic` maps a storage table's name to its policy, a mapping of hybridrec.types.Dynamic's
fields (admit, min_count, probability, evict, ttl_steps, halflife, unknown, buckets); keys left
out take Dynamic's defaults. A table named here takes raw int64 ids and maps them to its
num_embeddings slots while training (docs/dynamic.md). A leaf like the rest of the config: it
imports only the schema and hybridrec.types.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridrec.config.schema import ModelConfig
from hybridrec.types import Dynamic

POLICY_KEYS = tuple(f.name for f in dataclasses.fields(Dynamic))


def check_dynamic(m: ModelConfig) -> None:
    """ValueError of one line naming `model.dynamic.<table>[.<key>]` for a table the model does
    not have (a model class's tables are checked when it is built), a key
    that is not a policy key, a wrong value, or a table whose rows do not split into its
    buckets."""
    n = len(m.num_embeddings_per_feature)
    tables = list(m.table_names) if m.table_names else [f"cat_{i}" for i in range(n)]
    rows: dict[str, int] = {}
    for table, r in zip(tables, m.num_embeddings_per_feature, strict=True):
        rows.setdefault(table, int(r))
    for table, policy in (m.dynamic or {}).items():
        key = f"model.dynamic.{table}"
        if not isinstance(policy, dict):
            raise ValueError(
                f"{key} must be a mapping of policy keys ({', '.join(POLICY_KEYS)}), got "
                f"{policy!r}; e.g. +{key}.evict=lru"
            )
        if table not in rows and not m.built_by_class():
            raise ValueError(
                f"{key}: model {m.name} has no table {table!r}; its tables are "
                f"{', '.join(list(rows)[:8])}{' ...' if len(rows) > 8 else ''}"
            )
        unknown = [k for k in policy if k not in POLICY_KEYS]
        if unknown:
            raise ValueError(
                f"{key}.{unknown[0]} is not a policy key; keys: {', '.join(POLICY_KEYS)}"
            )
        policy_ = _typed(key, policy)
        try:
            d = Dynamic(**policy_)
        except ValueError as e:
            why = str(e).removeprefix("dynamic table: ")
            bad = next((k for k in POLICY_KEYS if why.startswith(k)), "evict")
            raise ValueError(f"{key}.{bad}: {why}") from None
        if table in rows and rows[table] % d.buckets:
            raise ValueError(
                f"{key}: the table's {rows[table]} rows (model.num_embeddings_per_feature) are "
                f"not a multiple of buckets={d.buckets}; every hash bucket holds rows / buckets "
                "slots: choose rows or buckets so that they divide"
            )


def _typed(key: str, policy: dict[str, Any]) -> dict[str, Any]:
    """Each value of the type of Dynamic's default (an int may stand for a float)."""
    default = Dynamic()
    out = {}
    for k, v in policy.items():
        want = type(getattr(default, k))
        ok = isinstance(v, want) or (want is float and isinstance(v, int))
        if isinstance(v, bool) or not ok:
            raise ValueError(f"{key}.{k} must be {want.__name__}, got {v!r}")
        out[k] = float(v) if want is float else v
    return out
