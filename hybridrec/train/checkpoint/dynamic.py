"""Dynamic tables in checkpoints: what a resume may change of a table's policy.

A checkpoint's signature records each dynamic table's policy (format.table_signature), and its
shards carry the map (the `dyn_*` row-wise state). The map's layout depends on three things,
which a resume may not change: the table's rows (its capacity) and `buckets` (an id sits in a
row of its hash bucket, rows // buckets of them), and `unknown` (under "row" each bucket's last
row is the shared unknown row, under "zeros" an id's). Nor may a table turn dynamic or fixed
(a dynamic table's rows belong to raw ids by slot, a fixed one's to vocabulary ids). Each of
these is refused in one line naming the key (`policy_refusal`); moving ids to other buckets
could not keep every id (a bucket may overflow), so no migration is attempted.

The other keys only steer decisions from the resumed step on, and may change (`policy_changes`
lists them for a warning): admit, min_count, probability (candidates keep their counts), evict,
ttl_steps, halflife (the LFU scores, last uses and totals are kept; an LFU run resumed from an
LRU or TTL one starts from the scores its ids had on admission).

A checkpoint written before policies were recorded has none to compare: its maps are still
checked row by row when loaded (hybridrec.sparse.dynamic.check), which refuses ids outside
their buckets and ids in unknown rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

# (table, key) -> the name a user sets it by: "capacity", a policy key, or "dynamic" (whether
# the table is dynamic at all)
KeyName = Callable[[str, str], str]
# the policy keys the saved map's layout depends on (with the table's rows)
LAYOUT_KEYS = ("buckets", "unknown")


def library_key(table: str, key: str) -> str:
    """How a library user sets `key` of `table` (hybridrec.Table / hybridrec.Dynamic)."""
    if key == "capacity":
        return f"the rows of dynamic table {table!r} (Table(rows=...))"
    if key == "dynamic":
        return f"Table({table!r}, dynamic=...)"
    return f"Dynamic.{key} of table {table!r}"


def _saved_tables(manifest: dict[str, Any]) -> dict[str, tuple[dict[str, Any], bool]]:
    """Per table of the checkpoint: (its signature entry, whether it is dynamic: it records a
    policy, or its shards carry a map, as checkpoints written before policies were recorded
    show)."""
    mapped = {s["table"] for s in manifest["shards"] if "dyn_slot_id" in s.get("state", ())}
    return {
        t["name"]: (t, "dynamic" in t or t["name"] in mapped)
        for t in manifest["signature"]["tables"]
    }


def _why(key: str, saved: Any, old: dict[str, Any]) -> str:
    if key == "capacity":
        return f"its ids sit in buckets of {saved // old['dynamic']['buckets']} rows"
    if key == "buckets":
        return f"its ids sit in the rows of their buckets of {saved}"
    if saved == "zeros":
        return "each bucket's last row holds an id, not an unknown row"
    return "each bucket's last row is its trained unknown row, no id's"


def policy_refusal(
    path: Path,
    manifest: dict[str, Any],
    current: list[dict[str, Any]],
    key_name: KeyName = library_key,
    anew: str = "load no checkpoint",
) -> str | None:
    """The one line refusing to load checkpoint `path` (its manifest) into tables `current`
    (table_signature entries) when a table turned dynamic or fixed, or a dynamic table's rows,
    buckets or unknown changed (module doc); None when none did. `key_name` names the keys as
    the caller's user sets them, `anew` says how to start without this checkpoint."""
    saved = _saved_tables(manifest)
    for cur in current:
        name = cur["name"]
        if name not in saved:
            continue  # signature_differences names it
        old, was = saved[name]
        now = cur.get("dynamic")
        if was != (now is not None):
            kinds = ("dynamic", "fixed") if was else ("fixed", "dynamic")
            return (
                f"checkpoint {path}: table {name!r} was trained {kinds[0]} and is {kinds[1]} in "
                f"the model ({key_name(name, 'dynamic')}): a dynamic table's rows belong to raw "
                f"ids by slot, a fixed one's to vocabulary ids; declare it {kinds[0]} to resume, "
                f"or train it anew ({anew})"
            )
        if now is None:
            continue
        changed = [("capacity", old["num_rows"], cur["num_rows"])] if "dynamic" in old else []
        changed += [(k, old["dynamic"].get(k), now[k]) for k in LAYOUT_KEYS if "dynamic" in old]
        for key, then, value in changed:
            if then != value:
                return (
                    f"checkpoint {path}: {key_name(name, key)} is {value!r}, but table {name!r} "
                    f"was trained with {then!r} ({_why(key, then, old)}); a resume cannot change "
                    f"it: set it back to {then!r} to resume, or train the table anew ({anew})"
                )
    return None


def policy_changes(manifest: dict[str, Any], current: list[dict[str, Any]]) -> list[str]:
    """The policy keys of dynamic tables that differ from the checkpoint's and may change
    (module doc), as "<table>.<key> <saved> -> <now>"."""
    saved = _saved_tables(manifest)
    out = []
    for cur in current:
        old = saved.get(cur["name"], ({}, False))[0].get("dynamic")
        now = cur.get("dynamic")
        if old is None or now is None:
            continue
        out += [
            f"{cur['name']}.{k} {old[k]!r} -> {v!r}"
            for k, v in now.items()
            if k in old and old[k] != v and k not in LAYOUT_KEYS
        ]
    return out
