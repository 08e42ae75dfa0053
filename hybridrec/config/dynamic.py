"""model.dynamic: which tables are dynamic and their policies, checked one key at a time.

`model.dynamic` maps a storage table's name to its policy, a mapping of Dynamic's fields
(admit, min_count, probability, evict, ttl_steps, halflife, unknown, buckets); keys left out
take Dynamic's defaults. A table named here takes raw int64 ids and maps them to its
num_embeddings slots while training (docs/dynamic.md). The policy's keys, types, choices and
ranges are checked by Dynamic itself (hybridrec.dynamic_policy, their one home), whose
PolicyError names the key; this module adds the config's names and the table's rows. A leaf
like the rest of the config: it imports only the schema and the policy.
"""

from __future__ import annotations

from hybridrec.config.schema import ModelConfig
from hybridrec.dynamic_policy import POLICY_KEYS, PolicyError, policy_of


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
        try:
            d = policy_of(dict(policy))
        except PolicyError as e:
            raise ValueError(f"{key}.{e.detail}") from None
        if table in rows and not d.fits(rows[table]):
            need = d.reserved_rows + 1
            raise ValueError(
                f"{key}: the table's {rows[table]} rows (model.num_embeddings_per_feature) do "
                f"not split into buckets={d.buckets} of >= {need} rows each"
                f"{' (one is its unknown row)' if d.reserved_rows else ''}: choose rows or "
                f"buckets so that rows / buckets is a whole number >= {need}"
            )
