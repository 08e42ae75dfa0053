"""Background admission: a host cache's worker thread and (on CUDA) side stream, and what a
prefetch hands to the lookup of its rows.

`Background.submit(fn, uses)` runs `fn` on the group's one worker thread; on CUDA inside the
side stream, ordered after the work the caller's stream has queued so far, with `uses` (the
caller's tensors that `fn` reads) recorded on the side stream so the allocator does not
recycle them early; it returns the job's Future. `join(made)` waits for it and orders the
caller's stream after it, recording on the caller's stream the tensors `fn` made there and
the caller goes on to use. One job is in flight at a time: the cache joins before its next
admission, flush, checkpoint view or stats.

`prefetch(rows)` returns a `Prefetched`: a value the staged batch carries to the lookup of
those rows (`lookup(..., prefetched=...)`), which then takes the slots and sort the admission
made (`Admitted`), with no sort and no sync. `PrefetchMixin` gives the cache `prefetch()`,
the hand-over (`_claim`) and `_wait()`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hybridrec.kernels.segment import Segments

_TICKETS = itertools.count(1)  # every prefetch of every group: its own number


@dataclass(frozen=True)
class Admitted:
    """A batch's rows [N] as an admission left them: all cached, in these slots."""

    per_id: torch.Tensor  # [N] slot of each id
    slots: torch.Tensor  # [U] slots of the distinct rows
    segments: Segments | None  # kernels.segment.sorted_segments(rows): the backward reuses it

    def made(self) -> list[torch.Tensor]:
        """The tensors the admission made (on the side stream, when it ran there)."""
        return [self.per_id, self.slots, *(self.segments or ())]


@dataclass(frozen=True)
class Prefetched:
    """What `prefetch(rows)` admitted, for the one lookup of the same rows (values, not this
    tensor): `ticket` names this prefetch (the cache checks it: another group's, an old or a
    used one is an error), `rows` [N] what it admitted; the admission's result, once it ran
    (`admitted()`, read by the cache after waiting for it): an Admitted, or None when the
    rows did not fit beside the step in flight (the lookup then admits them). Until that
    lookup, the cache keeps its slots from being evicted."""

    ticket: int
    rows: torch.Tensor
    result: Future

    def admitted(self) -> Admitted | None:
        assert self.result.done(), "the cache waits for the admission before reading it"
        return self.result.result()


def _done(value: Admitted | None) -> Future:
    """A Future already holding `value` (an admission that ran on the caller's thread)."""
    f: Future = Future()
    f.set_result(value)
    return f


class Background:
    """One worker thread for a group, with a side CUDA stream when `device` is CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hybridrec-cache")
        self._pending: Future | None = None
        self._done: torch.cuda.Event | None = None

    @property
    def pending(self) -> bool:
        """Whether a job was submitted and not joined yet."""
        return self._pending is not None

    def submit(self, fn: Callable[[], object], uses: Sequence[torch.Tensor | None]) -> Future:
        """Run `fn` on the thread; on CUDA on the side stream too, after the work queued so
        far. `uses`: tensors of this stream that `fn` reads (this thread may free them while
        the side stream still does). Returns its Future; `join()` waits for it."""
        if self.stream is None:
            self._pending = self._pool.submit(fn)
            return self._pending
        side = self.stream
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # this step's lookups are queued
        for t in uses:
            if t is not None:
                t.record_stream(side)
        done = torch.cuda.Event()

        def run() -> object:
            with torch.cuda.stream(side):
                side.wait_event(ready)
                out = fn()
                done.record(side)
                return out

        self._pending = self._pool.submit(run)
        self._done = done
        return self._pending

    def join(self, made: Callable[[], Sequence[torch.Tensor]]) -> None:
        """Block until the job in flight has run (re-raising its error) and order this
        stream after it. `made()`: the tensors it made on the side stream that this stream
        now uses and frees: the allocator must not hand their memory to the side stream
        again before this stream is done with them."""
        assert self._pending is not None
        self._pending.result()
        self._pending = None
        if self._done is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(self._done)
            self._done = None
            for t in made():
                t.record_stream(main)


class PrefetchMixin:
    """`prefetch()`, its hand-over to the lookup and the wait for it, for HostCachedEmbedding,
    which owns the worker (`_worker`), the admission (`_admit`, `_refresh`) and the state
    they read. `_reserved`: the last prefetch, until its lookup takes it (its slots are kept
    from eviction meanwhile)."""

    # Whether prefetch() admits on the background thread (else on the caller's, only the
    # rows moving there). None: on CUDA, where the admission's sync then waits for the side
    # stream only; not on the CPU, where there is no sync to hide and a second thread only
    # competes for the cores
    background: bool | None = None

    @torch.no_grad()
    def prefetch(self, rows: torch.Tensor) -> Prefetched:
        """Start admitting group rows `rows` [N] of the next batch; returns at once what it
        admits, for the lookup of those rows (`lookup(..., prefetched=...)`).

        Rows of the current step (looked up, backward pending) are not evicted, and the rows
        admitted stay cached until their lookup. When the cache cannot hold both steps'
        rows, nothing is admitted (the lookup admits them). A later prefetch replaces this
        one (its rows may then be evicted). The admission runs on the group's background
        thread and side CUDA stream (see `background`), beside the backward: the backward
        updates and marks dirty this step's slots, which the admission keeps; the admission
        maps and moves other rows. Triton's CPU interpreter (tests) is not thread-safe:
        interpreted copy kernels run here."""
        self._wait()
        if self._stale:
            self._refresh()
        self._reserved = None  # replaced: its rows may go now
        protected = self._protected
        if self.use_kernel and self._worker.stream is None:
            result = _done(self._admit(rows, prefetch=True, protected=protected))
        elif self.background or (self.background is None and self._worker.stream is not None):

            def job() -> Admitted | None:
                return self._admit(rows, prefetch=True, protected=protected)

            result = self._worker.submit(job, (rows, protected, self._free_slots))
        else:
            result = _done(self._admit(rows, prefetch=True, protected=protected, move_later=True))
        self._reserved = Prefetched(next(_TICKETS), rows, result)
        return self._reserved

    def _claim(self, prefetched: Prefetched, rows: torch.Tensor) -> Admitted | None:
        """The admission `prefetched` made, for the lookup of `rows` (called after _wait):
        it must be this cache's outstanding prefetch, of as many ids; their values are
        compared on the device (no sync), a difference raised by the next take_stats() or
        flush(). A mismatch is an error, never a quiet second admission."""
        if self._reserved is None or self._reserved.ticket != prefetched.ticket:
            raise RuntimeError(
                f"host cache of tables {self._names}: a lookup was handed a prefetch this "
                "cache does not hold (another group's, one already looked up, or one dropped "
                "by a later prefetch, a training lookup of other rows or a warm start); hand "
                "each prefetch() result to the one lookup of its rows"
            )
        if prefetched.rows.shape != rows.shape:
            raise RuntimeError(
                f"host cache of tables {self._names}: a lookup of {rows.numel():,} ids was "
                f"handed the prefetch of {prefetched.rows.numel():,} ids (another batch's)"
            )
        self._reserved = None
        if rows.numel():
            self._mismatched |= (rows != prefetched.rows).any()
        return prefetched.admitted()

    def _reserved_slots(self) -> torch.Tensor | None:
        """The slots the outstanding prefetch admitted (kept from eviction), if any."""
        admitted = self._reserved.admitted() if self._reserved is not None else None
        return admitted.slots if admitted is not None else None

    def _wait(self) -> None:
        """Block until a prefetch in flight has moved its rows (and order the device after it)."""
        if not self._worker.pending:
            return
        start = time.perf_counter()
        self._worker.join(self._made_on_side)
        with self._lock:
            self.stats.wait_s += time.perf_counter() - start

    def _made_on_side(self) -> list[torch.Tensor]:
        """Tensors a background admission made that this thread uses next."""
        admitted = self._reserved.admitted() if self._reserved is not None else None
        return [self._free_slots, *(admitted.made() if admitted is not None else ())]
