"""Host-resident embedding shards behind a device cache of hot rows (sharding=host).

For tables larger than device memory. The group's rows [R, D] and their optimizer state live
in host memory (pinned when the device is CUDA, so copies are DMA); the device holds C rows:

    cache_weight [C, D], cache_state_<name> [C] or [C, D]   the cached rows and their state
    slot_of      [R] int32   cache slot of each group row, -1 when not cached
    freq         [R] fp32    how often each row was used, cached or not, halved every
                             `age_every` lookups (sharding.cache_halflife; LFU with ageing:
                             yesterday's hot rows make way for today's; a row evicted and met
                             again keeps its history)
    row_of_slot  [C] int64   group row held by each slot, -1 when free
    dirty        [C] bool    updated since it was loaded: written back when evicted

A slot's score is its row's freq (`score`, read through row_of_slot when evicting).

Every lookup first *admits* its rows. The distinct rows (sorted) that are not cached are the
misses; when free slots run short, the lowest-score slots are evicted, except those of this
batch and of a step whose backward has not run yet, dirty ones written back to host memory.
The misses are read from host memory in sorted order (sequential reads, as the measurements
in DESIGN.md advise) into a pinned staging buffer, copied to the device and put in their
slots. The lookup and the optimizer then run on the cache exactly as FusedEmbedding runs on
its weight, so training equals the all-on-device group bit for bit: a row is only ever
updated in one place, and a row leaves the cache only with its latest values and state.

Rows move by one of two paths (`sharding.host_copy`): a GPU kernel that reads and writes the
pinned host rows directly through unified addressing (hybridrec.sparse.host_copy; no CPU
work), or staged copies (a CPU gather into a pinned buffer, then one DMA
copy; a write-back the reverse); `auto` times both once per group and keeps the faster.

Host syncs, which leave the GPU idle while the CPU catches up (the H100 profile of a host-
mode step showed it waiting on them, not on the GPU), are few:
- an admission reads the distinct-row count and the misses in one sync (`unique_padded`
  sorts without one), together with how many slots may be evicted when the last
  admission's misses outnumbered the free slots (else one more sync if it must evict); a
  prefetch's admission runs on a background thread, where that sync waits for a side
  stream only;
- the training lookup of the very rows the last prefetch admitted takes that prefetch's
  slots, with no sort and no sync, unless an admission evicted rows in between;
- free slots are a list, whose length is a shape the host knows;
- kernel copies write back only the dirty victims by skipping the clean ones, counted on
  the device (staged copies still sync for their CPU gather);
- the backward dedupes and updates like a device group, padded, with no sync, and takes
  the sort its lookup's admission (or prefetch) made of the same rows rather than sorting
  them again; a row evicted before its update (a bug) is noted on the device and raised by
  the next `take_stats()` or `flush()`.

`prefetch(rows)` admits the next batch's rows while the current step's backward is still to
run: the whole admission (its one sync included) and the host reads, write-backs and copies
run on a background thread and a side CUDA stream, overlapping the backward and the dense
optimizer, so a training step with prefetch never waits for the device on the main thread.
Any later admission, flush or checkpoint waits for it first. Prefetching never changes
results, only when rows move.

Bad input: not enough host memory is an error before anything is allocated
(`check_host_memory`); a pinned allocation that fails is reported with its size; a cache that
cannot hold one batch's distinct rows is an error naming the group, not a wrong result.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hybridrec.kernels import host_copy
from hybridrec.kernels import segment as triton_ops
from hybridrec.kernels.host_copy import copy_rows
from hybridrec.kernels.lookup import pool as _pool
from hybridrec.kernels.segment import Segments
from hybridrec.planner.planner import CACHE_META_BYTES, SLOT_BYTES
from hybridrec.sparse.fused import FusedEmbedding, LookupInput, RowOptimizer
from hybridrec.sparse.init import init_shard
from hybridrec.types import CACHE_HALFLIFE, ShardSpec, TableConfig

GIB = 1 << 30
log = logging.getLogger("hybridrec")


class HostMemoryError(RuntimeError):
    """Host-resident tables that do not fit in (or cannot be pinned in) host memory."""


class CacheTooSmallError(RuntimeError):
    """A device cache that cannot hold the distinct rows of one batch."""


def available_host_bytes() -> int:
    """Host memory the OS reports free for new allocations (MemAvailable), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(need: int, budget: int | None, what: str) -> None:
    """Raise HostMemoryError, before allocating, when `need` bytes exceed the budget
    (`sharding.host_gb`, else what the OS reports free)."""
    if budget is None:
        budget, source = available_host_bytes(), "free host memory (MemAvailable)"
    else:
        source = "sharding.host_gb"
    if need > budget:
        raise HostMemoryError(
            f"{what} need {need / GIB:.2f} GiB ({need:,} bytes) of host memory, but "
            f"{source} is {budget / GIB:.2f} GiB ({budget:,} bytes); use more ranks, "
            "fewer or smaller tables, or fp16/bf16 tables (model.table_dtype)"
        )


@dataclass
class CacheStats:
    """Counters since the last `take_stats()`. Rows are distinct rows per lookup."""

    rows_requested: int = 0  # distinct rows those lookups needed
    hits: int = 0  # ... of which were already cached (or prefetched)
    rows_loaded: int = 0  # host -> device
    rows_written: int = 0  # device -> host (dirty evictions and flushes)
    bytes_moved: int = 0  # both directions, rows and their optimizer state
    transfer_s: float = 0.0  # time spent moving rows (on the caller or the prefetch thread)
    wait_s: float = 0.0  # time lookups spent waiting for host memory (admission + prefetch)

    def add(self, other: CacheStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class _Prefetched:
    """What the last prefetch admitted. Its training lookup (of this very `rows` tensor)
    takes these slots and this sort, with no sort and no sync, when no admission evicted
    rows since (the group's eviction count is still `evictions`)."""

    rows: torch.Tensor  # [N] group rows, compared by identity
    per_id: torch.Tensor  # [N] slot of each id
    slots: torch.Tensor  # [U] slots of the distinct rows
    evictions: int
    segments: Segments | None  # triton_ops.sorted_segments(rows), for the backward too


def _empty_host(
    shape: tuple[int, ...], dtype: torch.dtype, pin: bool, what: str, exact: bool = False
) -> torch.Tensor:
    """Host memory for `what`, pinned when `pin`. `exact`: tables and their state, pinned
    by registration at exactly their size (host_copy.pinned_empty; torch's pinned allocator
    would round them up to a power of two); otherwise torch's caching pinned allocator,
    which recycles the per-step staging buffers."""
    try:
        if pin and exact:
            return host_copy.pinned_empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, pin_memory=pin)
    except (RuntimeError, MemoryError) as e:
        size = dtype.itemsize
        for n in shape:
            size *= n
        raise HostMemoryError(
            f"could not allocate {size / GIB:.2f} GiB of {'pinned ' if pin else ''}host memory "
            f"for {what}: {e}. Set sharding.pin_host=false (pageable memory, slower copies) or "
            "lower the tables' size"
        ) from None


HOST_COPY_MODES = ("auto", "kernel", "staged")


def unique_padded(
    rows: torch.Tensor, segments: Segments | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.unique(rows, return_inverse=True, return_counts=True) without a host sync:
    (distinct rows [N] ascending, inverse [N], counts [N], U [] on the device). Entries past
    U repeat the largest row with count 0, so they index valid rows and add nothing.
    `segments`: triton_ops.sorted_segments(rows), when made already."""
    if rows.numel() == 0:
        return rows, rows, rows, torch.zeros((), dtype=torch.int64, device=rows.device)
    perm, seg, uniq = segments if segments is not None else triton_ops.sorted_segments(rows)
    inverse = torch.empty_like(seg).index_put_((perm,), seg)
    counts = torch.zeros_like(seg).index_add_(0, seg, torch.ones_like(seg))
    return uniq, inverse, counts, seg[-1] + 1


def _kept(slots: torch.Tensor, protected: torch.Tensor | None) -> torch.Tensor:
    """Slots new rows may not take: this batch's (`slots`, -1 for its misses) and those
    whose backward is pending (`protected`)."""
    return slots if protected is None else torch.cat([slots, protected])


def _choose_copy(mode: str, device: torch.device, pinned: bool) -> bool:
    """Whether rows move by the UVA kernel (hybridrec.sparse.host_copy) rather than staged
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


class HostCachedEmbedding(FusedEmbedding):
    """A fused group whose rows live in host memory, with a device cache of `cache_rows` rows.

    Same interface as FusedEmbedding; `weight` and `state()` are the host tensors (the
    canonical copy after `flush()`), which is what checkpoints read and write.
    """

    evict_share = 1 / 64  # an eviction frees at least this share of the cache
    # Whether prefetch() admits on the background thread (else on the caller's, only the
    # rows moving there; benchmarks/host_cache.py --inline-prefetch compares). None: on CUDA,
    # where the admission's sync then waits for the side stream only; on the CPU there is
    # no sync to hide, and a second thread only competes for the cores (1.8x slower steps
    # measured on 2 cores)
    background: bool | None = None

    def __init__(
        self,
        shards: Sequence[tuple[TableConfig, int, ShardSpec]],
        optimizer: RowOptimizer | None,
        cache_rows: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        pin: bool = True,
        age_every: int = CACHE_HALFLIFE,
        copy: str = "auto",
    ) -> None:
        # read by _init_storage, which FusedEmbedding.__init__ calls
        self.pin = pin and torch.device(device).type == "cuda"
        self.capacity = int(cache_rows)
        super().__init__(shards, optimizer, seed, device, dtype)
        self.use_kernel = _choose_copy(copy, self.device, self.pin)
        if copy == "auto" and self.use_kernel and self.device.type == "cuda":
            self.use_kernel = self._kernel_copies_faster()
        if self.use_kernel and self.device.type == "cuda":
            self._compile_copies()
        self.age_every = age_every
        self.stats = CacheStats()
        self.prefetched_lookups = 0  # training lookups that took a prefetch's slots as is
        self.warm_hits = (0.0, 0.0)  # see warm_start
        self._protected: torch.Tensor | None = None  # slots whose backward is pending
        self._training_lookup = False
        self._counted_ahead = False  # the next training lookup's rows were counted by prefetch
        self._stale = False  # host rows were changed from outside: reload the cached ones
        self._pending: Future | None = None
        self._pending_event: torch.cuda.Event | None = None
        self._pool_thread = ThreadPoolExecutor(1, thread_name_prefix="hybridrec-cache")
        self._lock = threading.Lock()  # guards stats between the prefetch thread and callers
        self._pending_timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # -- storage ---------------------------------------------------------------------------
    def _init_storage(self, shards, seed, device, dtype) -> None:  # noqa: ANN001
        R, D = self.num_rows, self.width
        if not 1 <= self.capacity <= R:
            raise ValueError(f"cache of {self.capacity} rows for a group of {R} rows: need 1..{R}")
        self.device = device
        names = ", ".join(sorted({s.table for _, _, s in shards}))
        row_bytes = D * dtype.itemsize + sum(
            (shape[1] if len(shape) > 1 else 1) * 4 for shape in self.state_shapes.values()
        )
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            need = self.capacity * (row_bytes + CACHE_META_BYTES) + R * SLOT_BYTES
            if need > total:
                raise ValueError(
                    f"device cache for tables {names}: {self.capacity:,} rows need "
                    f"{need / GIB:.2f} GiB, more than the whole GPU ({total / GIB:.2f} GiB); "
                    "lower sharding.cache_fraction or sharding.cache_gb"
                )
        weight = _empty_host((R, D), dtype, self.pin, f"tables {names}", exact=True)
        for (t, i, s), a, b in zip(shards, self.offsets_list, self.offsets_list[1:], strict=False):
            init_shard(t, i, s, seed, dtype, out=weight[a:b])
        self.weight = weight  # plain attributes, not buffers: module.to() must not move them
        for name, shape in self.state_shapes.items():
            host = _empty_host(
                shape, torch.float32, self.pin, f"optimizer state of {names}", exact=True
            )
            setattr(self, f"state_{name}", host.zero_())
        C = self.capacity
        self.register_buffer("cache_weight", torch.zeros(C, D, dtype=dtype, device=device))
        for name, shape in self.state_shapes.items():
            self.register_buffer(f"cache_state_{name}", torch.zeros((C, *shape[1:]), device=device))
        self.register_buffer("slot_of", torch.full((R,), -1, dtype=torch.int32, device=device))
        self.register_buffer("freq", torch.zeros(R, device=device))
        self.register_buffer("row_of_slot", torch.full((C,), -1, dtype=torch.int64, device=device))
        self.register_buffer("dirty", torch.zeros(C, dtype=torch.bool, device=device))
        self._admissions = 0
        # free slots, taken from the front (their count is a shape: known without a sync)
        self._free_slots = torch.arange(C, device=device)
        self._evicted_early = torch.zeros((), dtype=torch.bool, device=device)
        self._ahead: _Prefetched | None = None  # what the last prefetch admitted
        # (rows, rows sorted) of the last training lookup: its backward dedupes the same
        # rows, so it takes this sort instead of sorting them again
        self._segments: tuple[torch.Tensor, Segments | None] | None = None
        # (inputs, flatten(inputs)) of the last flatten: a forward of the inputs prefetch()
        # flattened (the several-rank path) gets the very rows tensor the prefetch admitted
        self._flat: tuple[list[LookupInput], tuple] | None = None
        self._evictions = 0
        self._last_misses = 0  # the last admission's: more than the free slots, it evicts
        # rows written back by the kernel path, counted where they are known (on the device)
        self._written_on_device = torch.zeros((), dtype=torch.int64, device=device)
        self._row_bytes = row_bytes  # a row and its optimizer state

    @property
    def evictions(self) -> int:
        """How many times an admission has selected victims (a top-k over the whole cache:
        each frees at least `evict_share` of it)."""
        return self._evictions

    @property
    def _n_free(self) -> int:
        return self._free_slots.numel()

    @torch.no_grad()
    def _kernel_copies_faster(self, n: int = 1 << 16) -> bool:
        """host_copy=auto on CUDA: fill a scratch buffer with up to `n` sorted random rows
        both ways (median of 3 after a warmup) and keep the faster; logged."""
        n = min(n, self.num_rows)
        rows = torch.randint(0, self.num_rows, (n,)).unique()  # sorted (no 1.2 GB randperm)
        n = rows.numel()
        rows_dev, slots = rows.to(self.device), torch.arange(n, device=self.device)
        scratch = torch.empty(n, self.width, dtype=self.weight.dtype, device=self.device)

        def kernel() -> None:
            copy_rows(self.weight, rows_dev, scratch, slots)

        def staged() -> None:
            buf = _empty_host((n, self.width), self.weight.dtype, self.pin, "a copy test")
            torch.index_select(self.weight, 0, rows, out=buf)
            scratch.copy_(buf, non_blocking=True)

        times = {}
        for name, fn in (("kernel", kernel), ("staged", staged)):
            fn()
            runs = []
            for _ in range(3):
                torch.cuda.synchronize(self.device)
                start = time.perf_counter()
                fn()
                torch.cuda.synchronize(self.device)
                runs.append(time.perf_counter() - start)
            times[name] = sorted(runs)[1]
        log.info(
            "host cache (%d rows): a fill of %d rows takes %.2f ms by kernel (UVA), %.2f ms "
            "staged: using %s copies",
            self.capacity,
            n,
            1e3 * times["kernel"],
            1e3 * times["staged"],
            "kernel" if times["kernel"] <= times["staged"] else "staged",
        )
        return times["kernel"] <= times["staged"]

    @torch.no_grad()
    def _compile_copies(self) -> None:
        """Compile the copy kernel for each host tensor's dtype and width here, on the main
        thread, rather than on the prefetch thread at its first use (while this thread may
        be compiling the update kernels)."""
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        for host, cache in self._pairs():
            scratch = torch.empty((1, *cache.shape[1:]), dtype=cache.dtype, device=self.device)
            copy_rows(host, zero, scratch, zero)

    @property
    def score(self) -> torch.Tensor:
        """[C] fp32, a new tensor: each slot's row's use count (freq), 0 for a free slot.
        Eviction takes the lowest."""
        used = self.row_of_slot >= 0
        return torch.where(used, self.freq.index_select(0, self.row_of_slot.clamp(min=0)), 0.0)

    def cache_state(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, f"cache_state_{n}") for n in self.state_names}

    # -- lookups and updates ---------------------------------------------------------------
    def flatten(
        self, inputs: Sequence[LookupInput]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
        """FusedEmbedding.flatten, the same tensors again for the same (frozen) inputs as the
        last call: the forward of inputs whose rows prefetch() admitted then reuses its slots
        and its sort (which are keyed by the rows tensor)."""
        last = self._flat
        if last is not None and len(last[0]) == len(inputs):
            if all(a is b for a, b in zip(last[0], inputs, strict=True)):
                return last[1]
        out = super().flatten(inputs)
        self._flat = (list(inputs), out)
        return out

    def lookup(
        self,
        rows: torch.Tensor,
        bags: torch.Tensor,
        scale: torch.Tensor | None,
        num_bags: int,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        # pool() runs inside an autograd Function, where grad mode is off: note it here
        self._training_lookup = torch.is_grad_enabled() and self.optimizer is not None
        return super().lookup(rows, bags, scale, num_bags, out_dtype)

    def pool(
        self,
        rows: torch.Tensor,
        bags: torch.Tensor,
        scale: torch.Tensor | None,
        num_bags: int,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        start = time.perf_counter()
        slots_per_id, slots = self._admit(rows)
        if self._training_lookup:
            self._protected = slots  # their backward is pending: never evict them before it
        with self._lock:
            self.stats.wait_s += time.perf_counter() - start
        return _pool(self.cache_weight, slots_per_id, bags, scale, num_bags, out_dtype)

    def _sorted_segments(self, rows: torch.Tensor) -> Segments | None:
        """The admission's sort of the very `rows` tensor of the lookup being updated (the
        backward's dedupe sorts the same rows: it takes this instead), used once."""
        known, self._segments = self._segments, None
        return known[1] if known is not None and known[0] is rows else None

    def _update_target(
        self, unique_rows: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        slots = self.slot_of.index_select(0, unique_rows).long()
        # A row evicted between its lookup and its update would be a bug. Checked without a
        # host sync: noted on the device, raised by the next take_stats() or flush() (before
        # host memory is read), the update sent to slot 0 meanwhile instead of out of bounds.
        if slots.numel():
            self._evicted_early |= (slots < 0).any()
            slots = slots.clamp(min=0)
        self.dirty[slots] = True
        self._protected = None
        return self.cache_weight, self.cache_state(), slots

    def _raise_if_evicted_early(self) -> None:
        if bool(self._evicted_early):
            raise RuntimeError(
                "host cache: a row was evicted between its lookup and its update (a bug: "
                "please report it with the config)"
            )

    # -- admission ---------------------------------------------------------------------------
    @torch.no_grad()
    def _admit(
        self,
        rows: torch.Tensor,
        prefetch: bool = False,
        protected: torch.Tensor | None = None,
        move_later: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Make every row of `rows` [N] cached; returns (slot of each id [N], slots of the
        distinct rows [U]). `prefetch`: the next batch's rows (counted now, reused by its
        lookup), admitted beside `protected`, the slots of the step whose backward is to run
        (prefetch() runs this on its background thread and passes them). `move_later`: the
        rows move on the background thread (an admission here, rows moved there).

        None for the training lookup of the rows the last prefetch admitted (its slots are
        reused); else one host sync (U and the misses, read together, with how many slots
        may be evicted when the last admission's misses outnumbered the free slots), and a
        second only when it must evict unforeseen; sizes come from those, so nothing else
        waits for the device."""
        if not prefetch:
            self._wait()
            if self._stale:
                self._refresh()
            protected = self._protected
        ahead = self._ahead
        if (
            not prefetch
            and ahead is not None
            and ahead.rows is rows
            and ahead.evictions == self._evictions
            and self._training_lookup
            and self._counted_ahead
        ):
            # the rows the last prefetch admitted (and counted), all still in its slots
            self._ahead, self._counted_ahead = None, False
            self._segments = (rows, ahead.segments)
            self.prefetched_lookups += 1
            self._count_admission()
            return ahead.per_id, ahead.slots
        segments = triton_ops.sorted_segments(rows) if rows.numel() else None
        if self._training_lookup and not prefetch:
            self._segments = (rows, segments)
        uniq, inverse, counts, n_unique = unique_padded(rows, segments)
        slots = self.slot_of.index_select(0, uniq).long()  # -1: a miss (padding: a valid row)
        miss = slots < 0
        evictable, masked = None, None
        if rows.numel():
            real = torch.arange(miss.numel(), device=miss.device) < n_unique
            wanted = [n_unique, (miss & real).sum()]
            if self._n_free < self._last_misses:  # it will likely evict: read how many can go
                masked = self._eviction_scores(_kept(slots, protected))  # in the same sync
                wanted.append(torch.isfinite(masked).sum())
            u, n_miss, *rest = torch.stack(wanted).tolist()
            evictable = rest[0] if rest else None
        else:
            u, n_miss = 0, 0
        self._last_misses = n_miss
        uniq, counts, slots, miss = uniq[:u], counts[:u], slots[:u], miss[:u]
        # A prefetched batch is counted when prefetched (what was cached before it was
        # known), not again by its own lookup, which then finds everything cached.
        count = prefetch or not (self._training_lookup and self._counted_ahead)
        self._counted_ahead = prefetch or (self._counted_ahead and not self._training_lookup)
        if count:
            self.freq.index_add_(0, uniq, counts.float())
            with self._lock:
                self.stats.rows_requested += u
                self.stats.hits += u - n_miss
        if n_miss:
            # the missing rows' positions, ascending (so are their rows: sorted host reads)
            at = torch.sort(miss.to(torch.uint8), descending=True, stable=True).indices[:n_miss]
            chosen = self._choose_slots(n_miss, slots, protected, prefetch, masked, evictable)
            if chosen is None:
                return slots, slots  # a prefetch that does not fit: the lookup will admit
            new_slots, victims = chosen
            miss_rows = uniq.index_select(0, at)
            victim_rows = self.row_of_slot.index_select(0, victims)
            victim_dirty = self.dirty.index_select(0, victims)
            if victims.numel():
                self.slot_of.index_fill_(0, victim_rows, -1)
                self.row_of_slot.index_fill_(0, victims, -1)  # free, unless a new row takes it
                self.dirty.index_fill_(0, victims, False)
            self.slot_of.index_copy_(0, miss_rows, new_slots.to(torch.int32))
            self.row_of_slot.index_copy_(0, new_slots, miss_rows)
            self.dirty.index_fill_(0, new_slots, False)
            slots.index_copy_(0, at, new_slots)
            job = (victims, victim_rows, victim_dirty, new_slots, miss_rows)
            if move_later:
                self._in_background(lambda: self._move(*job), job)
            else:
                self._move(*job)
        per_id = slots.index_select(0, inverse)
        if prefetch:
            self._ahead = _Prefetched(rows, per_id, slots, self._evictions, segments)
        else:
            self._count_admission()
        return per_id, slots

    def _count_admission(self) -> None:
        """A lookup's admission: every `age_every` of them, use counts halve (ageing)."""
        self._admissions += 1
        if self._admissions % self.age_every == 0:
            self.freq.mul_(0.5)

    def _eviction_scores(self, keep: torch.Tensor) -> torch.Tensor:
        """[C]: each slot's score, inf for free slots and for `keep` (slots; -1 ignored)."""
        C = self.capacity
        score = self.score  # a gather over the whole cache: once
        masked = torch.cat([score, score.new_zeros(1)])  # [C + 1]: index C takes the -1s
        masked[self._free_slots] = float("inf")  # taken first, before any eviction
        masked.index_fill_(0, torch.where(keep < 0, C, keep), float("inf"))
        return masked[:C]

    def _choose_slots(
        self,
        n_miss: int,
        slots: torch.Tensor,
        protected: torch.Tensor | None,
        prefetch: bool,
        masked: torch.Tensor | None = None,
        evictable: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(`n_miss` slots for new rows, victims): free slots first, then the lowest-score
        slots outside this batch's `slots` [U] (-1 entries ignored) and `protected`, evicted
        (victims, returned so dirty ones are written back; in bulk, so there may be more
        victims than needed: they join the free slots). None when they do not fit and this
        is only a prefetch. `masked`, `evictable`: the eviction scores of those slots and
        their finite count, when read already."""
        take = min(n_miss, self._n_free)
        free = self._free_slots[:take]
        short = n_miss - take
        if short == 0:
            self._free_slots = self._free_slots[take:]
            return free, free.new_empty(0)
        C = self.capacity
        if masked is None or evictable is None:
            masked = self._eviction_scores(_kept(slots, protected))
            evictable = int(torch.isfinite(masked).sum())  # a second sync
        if evictable < short:
            if prefetch:
                return None
            raise CacheTooSmallError(
                f"host cache of tables {', '.join(sorted({s.table for s in self.shards}))}: "
                f"{self.capacity:,} rows cannot hold the {slots.numel():,} distinct rows of one "
                "batch next to the rows still in use; raise sharding.cache_fraction or "
                "sharding.cache_gb, or lower train.batch_size"
            )
        # evict in bulk (at least `evict_share` of the cache): one selection over the whole
        # cache then serves several steps' misses instead of one
        n_evict = min(evictable, max(short, int(C * self.evict_share)))
        victims = torch.topk(masked, n_evict, largest=False, sorted=False).indices
        self._evictions += 1
        self._free_slots = victims[short:]
        return torch.cat([free, victims[:short]]), victims

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

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host tensor, cache tensor) for the rows and every optimizer state."""
        pairs = [(self.weight, self.cache_weight)]
        cache = self.cache_state()
        pairs += [(host, cache[n]) for n, host in self.state().items()]
        return pairs

    def _copy_out(self, slots: torch.Tensor, rows: torch.Tensor) -> int:
        """host[rows] = cache[slots] for rows and state; returns bytes moved. The kernel path
        writes host memory asynchronously (`flush` syncs before anyone reads it) and skips
        entries whose row is -1 (counted in the bytes: callers that pass any count them)."""
        moved = 0
        if self.use_kernel:
            for host, cache in self._pairs():
                copy_rows(cache, slots, host, rows)
                moved += rows.numel() * cache[0].numel() * cache.element_size()
            return moved
        rows_cpu = rows.cpu()
        for host, cache in self._pairs():
            data = cache.index_select(0, slots)
            if data.device.type == "cuda":
                staged = _empty_host(tuple(data.shape), data.dtype, self.pin, "a write-back")
                staged.copy_(data, non_blocking=True)
                torch.cuda.current_stream(data.device).synchronize()
                data = staged
            host.index_copy_(0, rows_cpu, data)
            moved += data.numel() * data.element_size()
        return moved

    def _copy_in(self, slots: torch.Tensor, rows: torch.Tensor) -> int:
        """cache[slots] = host[rows] for rows and state (host rows sorted: sequential reads).
        Kernel path: one kernel per tensor reads the pinned rows; staged: a CPU gather into a
        pinned buffer, then one copy."""
        moved = 0
        if self.use_kernel:
            for host, cache in self._pairs():
                copy_rows(host, rows, cache, slots)
                moved += rows.numel() * cache[0].numel() * cache.element_size()
            return moved
        rows_cpu = rows.cpu()
        for host, cache in self._pairs():
            staged = _empty_host(
                (rows_cpu.numel(), *host.shape[1:]), host.dtype, self.pin, "a cache fill"
            )
            torch.index_select(host, 0, rows_cpu, out=staged)
            cache.index_copy_(0, slots, staged.to(cache.device, non_blocking=True))
            moved += staged.numel() * staged.element_size()
        return moved

    # -- prefetch ----------------------------------------------------------------------------
    @torch.no_grad()
    def prefetch(self, rows: torch.Tensor) -> None:
        """Start admitting group rows `rows` [N] of the next batch; returns at once.

        Rows of the current step (looked up, backward pending) are not evicted. When the cache
        cannot hold both steps' rows, nothing is prefetched (the next lookup admits them).

        The admission runs on a background thread (and a side CUDA stream): its host sync
        then waits for the side stream only, while this thread goes on queueing the
        backward, so the device never runs dry. What the two touch at the same time is
        disjoint: the backward updates and marks dirty this step's slots, which the
        admission keeps; the admission maps and moves other rows. Triton's CPU interpreter
        (tests) is not thread-safe: with interpreted copy kernels it runs here.

        Beside `train.compile=graphs`: inductor captures CUDA graphs in "thread_local" mode
        and sends only the capturing thread's allocations to the graph's pool (torch
        `_inductor/cudagraph_trees.py`), so this thread's sync and allocations, on its own
        stream, are allowed while the main thread captures (read from torch's source; not
        yet run on a GPU)."""
        self._wait()
        if self._stale:
            self._refresh()
        protected = self._protected
        if self.use_kernel and self._side is None:
            self._admit(rows, prefetch=True, protected=protected)
        elif self.background or (self.background is None and self._side is not None):
            uses = (rows, protected, self._free_slots)
            self._in_background(lambda: self._admit(rows, True, protected), uses)
        else:
            self._admit(rows, prefetch=True, protected=protected, move_later=True)

    def _in_background(self, fn: Callable[[], object], uses: Sequence[torch.Tensor | None]) -> None:
        """Run `fn` on the group's thread; on CUDA on the side stream too, after the work
        queued so far. `uses`: tensors of this stream that `fn` reads (this thread may free
        them while the side stream still does). `_wait()` joins it."""
        if self._side is None:
            self._pending = self._pool_thread.submit(fn)
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # this step's lookups are queued
        for t in uses:
            if t is not None:
                t.record_stream(self._side)
        done = torch.cuda.Event()

        def run() -> None:
            with torch.cuda.stream(self._side):
                self._side.wait_event(ready)
                fn()
                done.record(self._side)

        self._pending = self._pool_thread.submit(run)
        self._pending_event = done

    def _wait(self) -> None:
        """Block until a prefetch in flight has moved its rows (and order the device after it)."""
        if self._pending is None:
            return
        start = time.perf_counter()
        self._pending.result()
        self._pending = None
        if self._pending_event is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(self._pending_event)
            self._pending_event = None
            # made on the side stream, used and freed on this one: the allocator must not
            # hand their memory to the side stream again before this stream is done with it
            ahead = self._ahead
            made = [self._free_slots]
            if ahead is not None:
                made += [ahead.per_id, ahead.slots, *(ahead.segments or ())]
            for t in made:
                t.record_stream(main)
        with self._lock:
            self.stats.wait_s += time.perf_counter() - start

    # -- keeping host memory canonical ----------------------------------------------------------
    @torch.no_grad()
    def flush(self) -> None:
        """Write every dirty cached row back to host memory (rows stay cached)."""
        self._wait()
        self._raise_if_evicted_early()
        dirty = self.dirty.nonzero().squeeze(1)
        if dirty.numel():
            start = time.perf_counter()
            timing = self._gpu_timer()
            rows = self.row_of_slot.index_select(0, dirty)
            moved = self._copy_out(dirty, rows)
            self.dirty[dirty] = False
            with self._lock:
                self.stats.rows_written += rows.numel()
                self.stats.bytes_moved += moved
                self._add_transfer_time(start, timing)
            if self.use_kernel and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # host memory is read next

    @torch.no_grad()
    def _refresh(self) -> None:
        """Reload every cached row from host memory (after a checkpoint load wrote there)."""
        used = (self.row_of_slot >= 0).nonzero().squeeze(1)
        if used.numel():
            self._copy_in(used, self.row_of_slot.index_select(0, used))
        self._stale = False

    def shard_views(self) -> list[tuple[ShardSpec, torch.Tensor, dict[str, torch.Tensor]]]:
        """Views of the host rows, made current first. Callers may write into them (loading
        a checkpoint): cached rows are then reloaded before the next lookup."""
        self.flush()
        self._stale = True
        return super().shard_views()

    @torch.no_grad()
    def warm_start(self, frequency: torch.Tensor, ids_per_step: float) -> int:
        """Fill the cache with the most frequent rows (frequency [R]: counts per group row,
        e.g. from the dataset manifest) and give every row, cached or not, the use count it
        would have reached by now (`freq`): expected uses per step times the ageing window
        (age_every / ln 2 steps), the scale that lookups' counts settle at. Without that scale
        a row met once would outrank the warm rows and push them out. Returns the rows loaded.

        Also sets `warm_hits`: (sum over the cached rows, sum over all rows) of the chance a
        row is among a step's ids, were ids drawn by these counts (1 - e^-uses per step).
        Their ratio is the hit rate these rows give over a batch's distinct rows, the best any
        fixed set of this size gives: what the cache should reach while the data looks like
        its counts."""
        self._wait()
        if frequency.shape != (self.num_rows,):
            raise ValueError(f"frequency must be [{self.num_rows}], got {list(frequency.shape)}")
        self.flush()
        self.slot_of.fill_(-1)
        self.row_of_slot.fill_(-1)
        self.dirty.zero_()
        self._ahead = None  # its slots are gone
        self._free_slots = torch.arange(self.capacity, device=self.device)
        freq = frequency.double()
        total = float(freq.sum())
        n = min(self.capacity, int((freq > 0).sum()))
        if n == 0:
            return 0
        window = self.age_every / math.log(2)
        self.freq.copy_((freq * (ids_per_step * window / total)).float())
        top_dev = torch.topk(self.freq, n).indices.sort().values  # on the device: 188M rows
        present = -torch.expm1(-self.freq / window)  # a row in a step's ids; fp32, as freq
        cached = present[top_dev].sum(dtype=torch.float64)
        self.warm_hits = (float(cached), float(present.sum(dtype=torch.float64)))
        slots = torch.arange(n, device=self.device)
        self.slot_of[top_dev] = slots.to(torch.int32)
        self.row_of_slot[:n] = top_dev
        self._free_slots = torch.arange(n, self.capacity, device=self.device)
        self._copy_in(slots, top_dev)
        self._stale = False
        return n

    def take_stats(self) -> CacheStats:
        """The counters since the last call (and reset them); waits for a prefetch in flight."""
        self._wait()
        self._raise_if_evicted_early()
        written = int(self._written_on_device)
        self._written_on_device.zero_()
        with self._lock:
            out, self.stats = self.stats, CacheStats()
            timings, self._pending_timings = self._pending_timings, []
        out.rows_written += written
        out.bytes_moved += written * self._row_bytes
        for a, b in timings:  # kernel copies: GPU time (waits for them to finish)
            b.synchronize()
            out.transfer_s += a.elapsed_time(b) / 1e3
        return out

    def cached_fraction(self) -> float:
        return int((self.row_of_slot >= 0).sum()) / self.num_rows
