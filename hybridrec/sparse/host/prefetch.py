"""Background admission: a host cache's worker thread and (on CUDA) side stream.

`Background.submit(fn, uses)` runs `fn` on the group's one worker thread; on CUDA inside the
side stream, ordered after the work the caller's stream has queued so far, with `uses` (the
caller's tensors that `fn` reads) recorded on the side stream so the allocator does not
recycle them early. `join(made)` waits for it and orders the caller's stream after it,
recording on the caller's stream the tensors `fn` made there and the caller goes on to use.
One job is in flight at a time: the cache joins before its next admission, flush,
checkpoint view or stats. `_Prefetched` is what the last prefetch admitted, handed to the
training lookup of the same rows. `PrefetchMixin` gives the cache `prefetch()` and `_wait()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hybridrec.kernels.segment import Segments


@dataclass
class _Prefetched:
    """What the last prefetch admitted. Its training lookup (of this very `rows` tensor)
    takes these slots and this sort, with no sort and no sync, when no admission evicted
    rows since (the group's eviction count is still `evictions`)."""

    rows: torch.Tensor  # [N] group rows, compared by identity
    per_id: torch.Tensor  # [N] slot of each id
    slots: torch.Tensor  # [U] slots of the distinct rows
    evictions: int
    segments: Segments | None  # kernels.segment.sorted_segments(rows), for the backward too

    def made(self) -> list[torch.Tensor]:
        """The tensors the admission made (on the side stream, when it ran there)."""
        return [self.per_id, self.slots, *(self.segments or ())]


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

    def submit(self, fn: Callable[[], object], uses: Sequence[torch.Tensor | None]) -> None:
        """Run `fn` on the thread; on CUDA on the side stream too, after the work queued so
        far. `uses`: tensors of this stream that `fn` reads (this thread may free them while
        the side stream still does). `join()` waits for it."""
        if self.stream is None:
            self._pending = self._pool.submit(fn)
            return
        side = self.stream
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # this step's lookups are queued
        for t in uses:
            if t is not None:
                t.record_stream(side)
        done = torch.cuda.Event()

        def run() -> None:
            with torch.cuda.stream(side):
                side.wait_event(ready)
                fn()
                done.record(side)

        self._pending = self._pool.submit(run)
        self._done = done

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
    """`prefetch()` and the wait for it, for HostCachedEmbedding, which owns the worker
    (`_worker`), the admission (`_admit`, `_refresh`) and the state they read."""

    # Whether prefetch() admits on the background thread (else on the caller's, only the
    # rows moving there). None: on CUDA, where the admission's sync then waits for the side
    # stream only; not on the CPU, where there is no sync to hide and a second thread only
    # competes for the cores
    background: bool | None = None

    @torch.no_grad()
    def prefetch(self, rows: torch.Tensor) -> None:
        """Start admitting group rows `rows` [N] of the next batch; returns at once.

        Rows of the current step (looked up, backward pending) are not evicted. When the cache
        cannot hold both steps' rows, nothing is prefetched (the next lookup admits them).
        The admission runs on the group's background thread and side CUDA stream (see
        `background`), beside the backward: the backward updates and marks dirty this
        step's slots, which the admission keeps; the admission maps and moves other rows.
        Triton's CPU interpreter (tests) is not thread-safe: interpreted copy kernels run
        here."""
        self._wait()
        if self._stale:
            self._refresh()
        protected = self._protected
        if self.use_kernel and self._worker.stream is None:
            self._admit(rows, prefetch=True, protected=protected)
        elif self.background or (self.background is None and self._worker.stream is not None):
            uses = (rows, protected, self._free_slots)
            self._worker.submit(lambda: self._admit(rows, True, protected), uses)
        else:
            self._admit(rows, prefetch=True, protected=protected, move_later=True)

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
        ahead = self._ahead
        return [self._free_slots, *(ahead.made() if ahead is not None else ())]
