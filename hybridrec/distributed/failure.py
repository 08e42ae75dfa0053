"""A failed collective as one line a user can act on: which exchange, where, who is missing.

Every collective in hybridrec runs inside `exchange(name, group)`. When the backend raises
because a peer never came (gloo: a timeout after the group's timeout) or went away (a peer
that closed its connection), the rank raises CollectiveError naming the exchange, the
position the trainer last recorded (`set_position`: "training step 3", "evaluation after
step 3"), what happened, and the ranks that did not arrive. To find those, each failing rank
leaves `<exchange> at <position>` under its rank in the process group's store and reads the
others' for at most ARRIVAL_WAIT_S: a rank without a key is dead or stuck elsewhere. Every
store access runs in a daemon thread under a short timeout, so a store whose host died
(rank 0 hosts the TCPStore) makes the ranks "unknown", never a hang or a second error.
The group is unusable after a failure: every later collective fails at once, and
destroy_distributed skips its barrier, so no one waits a second timeout. Other errors (a
wrong shape: a bug, not a peer) pass through unchanged. On success the cost is a flag test
and a `try`; nothing is written anywhere until a collective fails.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

ARRIVAL_WAIT_S = 2.0  # how long a failing rank waits for the others' notes in the store
_STORE_TIMEOUT = timedelta(seconds=1)
_KEY = "hybridrec/collective_failed/rank_"
_state: dict[str, object] = {
    "position": "before the first training step",
    "timeout_s": None,
    "failed": "",  # the first failed collective's error: the group is unusable after it
}


class CollectiveError(RuntimeError):
    """A collective failed because a peer did not arrive or went away (message: one line)."""


def group_started(timeout_s: float) -> None:
    """A new process group with this timeout (init_distributed): nothing failed yet."""
    _state.update(timeout_s=timeout_s, failed="", position="before the first training step")


def set_position(where: str) -> None:
    """Where this rank is now, e.g. "training step 3" (the trainer records it)."""
    _state["position"] = where


def failed() -> bool:
    """Whether a collective failed in this process (its group is then unusable)."""
    return bool(_state["failed"])


def position() -> str:
    return str(_state["position"])


@contextlib.contextmanager
def at(where: str) -> Iterator[None]:
    """`where` is the position for the duration (evaluation, a checkpoint save)."""
    before = position()
    set_position(where)
    try:
        yield
    finally:
        set_position(before)


@contextlib.contextmanager
def exchange(name: str, group: dist.ProcessGroup | None) -> Iterator[None]:
    """Run one collective (or several under one name); a peer's failure -> CollectiveError.
    After one failed, every later one fails at once instead of waiting another timeout."""
    if _state["failed"]:
        raise CollectiveError(f"collective {name!r} not started: {_state['failed']}")
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        what = _what_happened(e)
        if what is None or not dist.is_initialized():
            raise
        where = position()
        tag = f"{name!r} {where if where.startswith('before') else 'at ' + where}"
        rank = dist.get_rank()
        missing = _who_did_not_arrive(tag, group, timed_out=what.startswith("timed out"))
        _state["failed"] = f"collective {tag} failed on rank {rank}: {what}; {missing}"
        raise CollectiveError(_state["failed"]) from e


def _what_happened(e: RuntimeError) -> str | None:
    text = str(e).lower()
    if "timed out" in text or "timeout" in text:
        waited = re.search(r"timed out waiting (\d+)\s*ms", text)  # gloo: the group's own
        t = int(waited.group(1)) / 1000 if waited else _state["timeout_s"]
        after = f" after {t:g} s (dist.timeout_s)" if isinstance(t, (int, float)) else ""
        return f"timed out{after} waiting for the other ranks"
    if any(s in text for s in ("closed by peer", "connection reset", "broken pipe", "refused")):
        return "a peer closed its connection (it exited or crashed)"
    if isinstance(e, dist.DistError):
        return f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return None


def _who_did_not_arrive(tag: str, group: dist.ProcessGroup | None, timed_out: bool) -> str:
    """Leave `tag` in the store, read the other ranks' tags; never blocks past a few seconds.
    After a timeout every rank that was in the exchange times out together, so a silent rank
    did not arrive; after a closed connection the others may still be waiting for theirs."""
    found: dict[str, object] = {}

    def run() -> None:
        with contextlib.suppress(Exception):  # a store that is gone: the ranks are unknown
            _read_notes(tag, group, found)

    thread = threading.Thread(target=run, name="hybridrec-arrivals", daemon=True)
    thread.start()
    thread.join(ARRIVAL_WAIT_S + 2 * _STORE_TIMEOUT.total_seconds())
    if thread.is_alive() or "seen" not in found:
        return "which ranks did not arrive is unknown (the process group's store did not answer)"
    ranks, seen = found["ranks"], found["seen"]
    assert isinstance(ranks, list) and isinstance(seen, dict)
    missing = [r for r in ranks if r not in seen]
    elsewhere = [f"rank {r} failed in {t} instead" for r, t in seen.items() if t != tag]
    parts = []
    if missing:
        who = ", ".join(map(str, missing))
        s = "s" if len(missing) > 1 else ""
        if timed_out:
            parts.append(f"rank{s} {who} did not arrive (dead, or stuck elsewhere)")
        else:
            parts.append(f"no word from rank{s} {who} (dead, or still waiting on the dead one)")
    parts += elsewhere
    return "; ".join(parts) or "every rank arrived (the connection between them failed)"


def _read_notes(tag: str, group: dist.ProcessGroup | None, found: dict[str, object]) -> None:
    """Leave this rank's note, collect the others' for up to ARRIVAL_WAIT_S, into `found`."""
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(_STORE_TIMEOUT)
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    store.set(f"{_KEY}{me}", tag)
    seen = {me: tag}
    deadline = time.monotonic() + ARRIVAL_WAIT_S
    while len(seen) < len(ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
        for r in ranks:
            if r not in seen and store.check([f"{_KEY}{r}"]):
                seen[r] = store.get(f"{_KEY}{r}").decode()
    found.update(ranks=ranks, seen=seen)
