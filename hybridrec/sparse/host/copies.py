"""The two ways rows move between host tensors and a device cache (`sharding.host_copy`).

`kernel`: a GPU kernel reads and writes the pinned host rows directly through unified
addressing (hybridrec.kernels.host_copy): no CPU work, and a write-back skips entries whose
row is -1, so clean victims need no host sync to be left out. `staged`: a CPU gather into a
pinned buffer, then one DMA copy (a write-back the reverse; it syncs for the CPU side).
`auto`: the kernel where it can run, and on CUDA whichever of the two fills faster, timed
once per group. Either way the same values land in the same places: the path changes when
rows move, never what they hold.

`pairs` is [(host tensor, cache tensor)] for the rows and each optimizer state; slots index
the cache tensors, rows the host ones (host rows sorted: sequential reads). `MoverMixin`
gives the cache its moves (`_move`, `_copy_in`, `_copy_out`) with their counters and timing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from hybridrec.kernels import host_copy
from hybridrec.kernels.host_copy import copy_rows
from hybridrec.sparse.host.memory import _empty_host

log = logging.getLogger("hybridrec")

HOST_COPY_MODES = ("auto", "kernel", "staged")

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


def _choose_copy(mode: str, device: torch.device, pinned: bool) -> bool:
    """Whether rows move by the UVA kernel (hybridrec.kernels.host_copy) rather than staged
    copies: `sharding.host_copy` auto = the kernel where it works (CUDA, pinned tables; the
    group then also times both and keeps the faster)."""
    if mode not in HOST_COPY_MODES:
        raise ValueError(f"sharding.host_copy={mode!r} is not one of: {', '.join(HOST_COPY_MODES)}")
    if mode == "staged":
        return False
    interpreted = device.type == "cpu" and host_copy._interpreting() and host_copy.triton
    works = bool(interpreted) or (pinned and host_copy.kernel_works(device))
    if mode == "kernel" and not works:
        raise ValueError(
            "sharding.host_copy=kernel: a GPU kernel cannot read this machine's pinned host "
            f"memory (device {device}, pinned tables: {pinned}); use host_copy=staged or auto"
        )
    return works


def copy_out(pairs: Pairs, slots: torch.Tensor, rows: torch.Tensor, kernel: bool, pin: bool) -> int:
    """host[rows] = cache[slots] for every pair; returns bytes moved. The kernel path writes
    host memory asynchronously (read it only after a device sync) and skips entries whose
    row is -1 (counted in the bytes: callers that pass any count them)."""
    moved = 0
    if kernel:
        for host, cache in pairs:
            copy_rows(cache, slots, host, rows)
            moved += rows.numel() * cache[0].numel() * cache.element_size()
        return moved
    rows_cpu = rows.cpu()
    for host, cache in pairs:
        data = cache.index_select(0, slots)
        if data.device.type == "cuda":
            staged = _empty_host(tuple(data.shape), data.dtype, pin, "a write-back")
            staged.copy_(data, non_blocking=True)
            torch.cuda.current_stream(data.device).synchronize()
            data = staged
        host.index_copy_(0, rows_cpu, data)
        moved += data.numel() * data.element_size()
    return moved


def copy_in(pairs: Pairs, slots: torch.Tensor, rows: torch.Tensor, kernel: bool, pin: bool) -> int:
    """cache[slots] = host[rows] for every pair; returns bytes moved. Kernel path: one kernel
    per tensor reads the pinned rows; staged: a CPU gather into a pinned buffer, one copy."""
    moved = 0
    if kernel:
        for host, cache in pairs:
            copy_rows(host, rows, cache, slots)
            moved += rows.numel() * cache[0].numel() * cache.element_size()
        return moved
    rows_cpu = rows.cpu()
    for host, cache in pairs:
        staged = _empty_host((rows_cpu.numel(), *host.shape[1:]), host.dtype, pin, "a cache fill")
        torch.index_select(host, 0, rows_cpu, out=staged)
        cache.index_copy_(0, slots, staged.to(cache.device, non_blocking=True))
        moved += staged.numel() * staged.element_size()
    return moved


@torch.no_grad()
def compile_copies(pairs: Pairs, device: torch.device) -> None:
    """Compile the copy kernel for each host tensor's dtype and width now, on the calling
    (main) thread, rather than on the prefetch thread at its first use (while the main
    thread may be compiling the update kernels). Host rows are untouched."""
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    for host, cache in pairs:
        scratch = torch.empty((1, *cache.shape[1:]), dtype=cache.dtype, device=device)
        copy_rows(host, zero, scratch, zero)


@torch.no_grad()
def kernel_copies_faster(
    weight: torch.Tensor, device: torch.device, pin: bool, capacity: int, n: int = 1 << 16
) -> bool:
    """host_copy=auto on CUDA: fill a scratch buffer with up to `n` sorted random rows of the
    host `weight` both ways (median of 3 after a warmup) and keep the faster; logged."""
    num_rows, width = weight.shape
    n = min(n, num_rows)
    rows = torch.randint(0, num_rows, (n,)).unique()  # sorted (no 1.2 GB randperm)
    n = rows.numel()
    rows_dev, slots = rows.to(device), torch.arange(n, device=device)
    scratch = torch.empty(n, width, dtype=weight.dtype, device=device)

    def kernel() -> None:
        copy_rows(weight, rows_dev, scratch, slots)

    def staged() -> None:
        buf = _empty_host((n, width), weight.dtype, pin, "a copy test")
        torch.index_select(weight, 0, rows, out=buf)
        scratch.copy_(buf, non_blocking=True)

    times = {}
    for name, fn in (("kernel", kernel), ("staged", staged)):
        fn()
        runs = []
        for _ in range(3):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            runs.append(time.perf_counter() - start)
        times[name] = sorted(runs)[1]
    log.info(
        "host cache (%d rows): a fill of %d rows takes %.2f ms by kernel (UVA), %.2f ms "
        "staged: using %s copies",
        capacity,
        n,
        1e3 * times["kernel"],
        1e3 * times["staged"],
        "kernel" if times["kernel"] <= times["staged"] else "staged",
    )
    return times["kernel"] <= times["staged"]


class MoverMixin:
    """Row moves for HostCachedEmbedding (which owns `_pairs()`, `use_kernel`, `pin`, the
    stats and their lock): write-backs and fills by the chosen path, counted and timed."""

    def _move(
        self,
        victims: torch.Tensor,
        victim_rows: torch.Tensor,
        victim_dirty: torch.Tensor,
        new_slots: torch.Tensor,
        miss_rows: torch.Tensor,
    ) -> None:
        """Write back the dirty victims, then load the missing rows into their slots."""
        start = time.perf_counter()
        timing = self._gpu_timer()
        moved = 0
        written = 0
        if victims.numel() and self.use_kernel:
            # the kernel skips the clean victims (row -1): no host sync to pick the dirty
            # ones; they are counted on the device and read by take_stats()
            self._copy_out(victims, torch.where(victim_dirty, victim_rows, -1))
            self._written_on_device += victim_dirty.sum()
        elif victims.numel():
            out_slots = victims[victim_dirty]
            if out_slots.numel():
                out_rows = victim_rows[victim_dirty]
                moved += self._copy_out(out_slots, out_rows)
                written = out_rows.numel()
        moved += self._copy_in(new_slots, miss_rows)
        with self._lock:
            self.stats.rows_loaded += miss_rows.numel()
            self.stats.rows_written += written
            self.stats.bytes_moved += moved
            self._add_transfer_time(start, timing)

    def _copy_out(self, slots: torch.Tensor, rows: torch.Tensor) -> int:
        """host[rows] = cache[slots] for rows and state (see copies.copy_out)."""
        return copy_out(self._pairs(), slots, rows, self.use_kernel, self.pin)

    def _copy_in(self, slots: torch.Tensor, rows: torch.Tensor) -> int:
        """cache[slots] = host[rows] for rows and state (see copies.copy_in)."""
        return copy_in(self._pairs(), slots, rows, self.use_kernel, self.pin)

    def _gpu_timer(self) -> torch.cuda.Event | None:
        """Kernel copies run asynchronously: time them on the stream (read in take_stats)."""
        if not (self.use_kernel and self.device.type == "cuda"):
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _add_transfer_time(self, start: float, event: torch.cuda.Event | None) -> None:
        """Staged copies: the wall time (the CPU gather dominates). Kernel copies: GPU time
        between two events, summed when the stats are taken. Call with the lock held."""
        if event is None:
            self.stats.transfer_s += time.perf_counter() - start
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending_timings.append((event, end))
