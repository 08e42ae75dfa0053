"""HostCachedEmbedding: a fused group whose rows live in host memory behind a device cache.

The group's rows [R, D] and optimizer state stay in host memory (pinned on CUDA); the device
holds C rows and their state in slots, with the maps (legend: R group rows, C slots, N ids):

    cache_weight [C, D], cache_state_<name> [C] or [C, D]   the cached rows and their state
    slot_of [R] int32 (-1: not cached)   row_of_slot [C] int64 (-1: free)
    freq [R] fp32 (use counts, see policy)   dirty [C] bool (updated since loaded)

Invariants: slot_of and row_of_slot are inverse on cached rows; `_free_slots` lists exactly
the slots holding no row; a slot of this batch or of a step whose backward is pending is
never evicted; a row leaves the cache only with its latest values and state (dirty ones are
written back). Every lookup admits its rows, then lookup and optimizer run on the cache as
FusedEmbedding runs on its weight: results equal the all-on-device group bit for bit.
A prefetch's admission is handed to the lookup of its rows by value (prefetch.Prefetched,
carried by the staged batch): that lookup takes its slots and sort, and the backward takes
the sort from its own lookup (through autograd's context), never by identity or a flag.
The policy lives in policy.py; row moves (copies.MoverMixin) and prefetch
(prefetch.PrefetchMixin) are mixed in. docs/host-cache.md explains the design.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from hybridrec.kernels import segment
from hybridrec.kernels.lookup import pool
from hybridrec.kernels.segment import Segments
from hybridrec.sparse.costs import CACHE_META_BYTES, SLOT_BYTES
from hybridrec.sparse.fused import FusedEmbedding, RowOptimizer
from hybridrec.sparse.host import copies, policy
from hybridrec.sparse.host.memory import GIB, _empty_host
from hybridrec.sparse.host.prefetch import Admitted, Background, Prefetched, PrefetchMixin
from hybridrec.sparse.host.stats import CacheStats
from hybridrec.sparse.init import init_shard
from hybridrec.types import CACHE_HALFLIFE, ShardSpec, TableConfig


class CacheTooSmallError(RuntimeError):
    """A device cache that cannot hold the distinct rows of one batch."""


class HostCachedEmbedding(PrefetchMixin, copies.MoverMixin, FusedEmbedding):
    """A fused group whose rows live in host memory, with a device cache of `cache_rows` rows.

    Same interface as FusedEmbedding; `weight` and `state()` are the host tensors (the
    canonical copy after `flush()`), which is what checkpoints read and write.
    """

    evict_share = 1 / 64  # an eviction frees at least this share of the cache

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
        input_slots: Sequence[int] | None = None,
    ) -> None:
        # read by _init_storage, which FusedEmbedding.__init__ calls
        self.pin = pin and torch.device(device).type == "cuda"
        self.capacity = int(cache_rows)
        super().__init__(shards, optimizer, seed, device, dtype, input_slots)
        self.use_kernel = copies._choose_copy(copy, self.device, self.pin)
        if copy == "auto" and self.use_kernel and self.device.type == "cuda":
            self.use_kernel = copies.kernel_copies_faster(
                self.weight, self.device, self.pin, self.capacity
            )
        if self.use_kernel and self.device.type == "cuda":
            self._compile_copies()
        self.age_every = age_every
        self.stats = CacheStats()
        self.prefetched_lookups = 0  # training lookups that took a prefetch's slots as is
        self.warm_hits = (0.0, 0.0)  # see warm_start
        self._protected: torch.Tensor | None = None  # slots whose backward is pending
        self._reserved: Prefetched | None = None  # the last prefetch, until its lookup
        self._stale = False  # host rows were changed from outside: reload the cached ones
        self._worker = Background(self.device)
        self._lock = threading.Lock()  # guards stats between the prefetch thread and callers
        self._pending_timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    # -- storage ---------------------------------------------------------------------------
    def _init_storage(self, shards, seed, device, dtype) -> None:  # noqa: ANN001
        R, D = self.num_rows, self.width
        if not 1 <= self.capacity <= R:
            raise ValueError(f"cache of {self.capacity} rows for a group of {R} rows: need 1..{R}")
        self.device = device
        self._names = names = ", ".join(sorted({s.table for _, _, s in shards}))
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
        # bugs noted on the device (no sync), raised by take_stats() and flush(): a row evicted
        # between its lookup and its update; a lookup of other rows than its prefetch's
        self._evicted_early = torch.zeros((), dtype=torch.bool, device=device)
        self._mismatched = torch.zeros((), dtype=torch.bool, device=device)
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

    def _compile_copies(self) -> None:
        """Compile the copy kernels now, on the main thread (copies.compile_copies)."""
        copies.compile_copies(self._pairs(), self.device)

    @property
    def score(self) -> torch.Tensor:
        """[C] fp32, a new tensor: each slot's row's use count (freq), 0 for a free slot.
        Eviction takes the lowest."""
        return policy.slot_scores(self.freq, self.row_of_slot)

    def cache_state(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, f"cache_state_{n}") for n in self.state_names}

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host tensor, cache tensor) for the rows and every optimizer state."""
        pairs = [(self.weight, self.cache_weight)]
        cache = self.cache_state()
        pairs += [(host, cache[n]) for n, host in self.state().items()]
        return pairs

    # -- lookups and updates ---------------------------------------------------------------
    def pool(
        self,
        rows: torch.Tensor,
        bags: torch.Tensor,
        scale: torch.Tensor | None,
        num_bags: int,
        out_dtype: torch.dtype = torch.float32,
        prefetched: Prefetched | None = None,
        training: bool = False,
    ) -> tuple[torch.Tensor, Segments | None]:
        """Admit `rows` [N] (or take what `prefetched`, this cache's prefetch of the same
        rows, admitted), then pool from the cache through their slots. `training`: their
        backward is pending, so their slots are protected until it ran; a training lookup
        without its prefetch drops the outstanding one (that batch never comes)."""
        start = time.perf_counter()
        self._wait()
        if self._stale:
            self._refresh()
        admitted = None
        if prefetched is not None:
            admitted = self._claim(prefetched, rows)
        elif training:
            self._reserved = None
        if admitted is None:  # a prefetch's rows were counted when prefetched
            admitted = self._admit(
                rows,
                protected=self._protected,
                reserved=self._reserved_slots(),
                count=prefetched is None,
            )
        else:
            self.prefetched_lookups += 1
        self._count_admission()
        if training:
            self._protected = admitted.slots  # never evict them before their backward
        with self._lock:
            self.stats.wait_s += time.perf_counter() - start
        out = pool(self.cache_weight, admitted.per_id, bags, scale, num_bags, out_dtype)
        return out, admitted.segments

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
        self.dirty.index_fill_(0, slots, True)  # a scalar argument: no copy to the device
        self._protected = None
        return self.cache_weight, self.cache_state(), slots

    def _raise_if_broken(self) -> None:
        """Raise what the sync-free checks noted on the device (bugs, named as such)."""
        early, mismatched = torch.stack([self._evicted_early, self._mismatched]).tolist()
        if early:
            raise RuntimeError(
                "host cache: a row was evicted between its lookup and its update (a bug: "
                "please report it with the config)"
            )
        if mismatched:
            raise RuntimeError(
                f"host cache of tables {self._names}: a lookup was handed the prefetch of other "
                "rows (another batch's, of the same size): its results used that batch's slots"
            )

    # -- admission ---------------------------------------------------------------------------
    @torch.no_grad()
    def _admit(
        self,
        rows: torch.Tensor,
        *,
        prefetch: bool = False,
        protected: torch.Tensor | None = None,
        reserved: torch.Tensor | None = None,
        count: bool = True,
        move_later: bool = False,
    ) -> Admitted | None:
        """Make every row of `rows` [N] cached: their slots and sort. `protected`: slots of
        the step whose backward is pending; `reserved`: those of the outstanding prefetch;
        neither is evicted. `count`: count the rows' uses (a prefetched batch's are counted
        when prefetched, not again by its lookup). `prefetch`: the next batch's rows
        (prefetch() runs this on its background thread): None when they do not fit.
        `move_later`: the rows move on the background thread.

        One host sync (U and the misses, read together, with how many slots may be evicted
        when the last admission's misses outnumbered the free slots), and a second only when
        it must evict unforeseen; sizes come from those, so nothing else waits for the
        device."""
        segments = segment.sorted_segments(rows) if rows.numel() else None
        uniq, inverse, counts, n_unique = policy.unique_padded(rows, segments)
        slots = self.slot_of.index_select(0, uniq).long()  # -1: a miss (padding: a valid row)
        miss = slots < 0
        evictable, masked = None, None
        if rows.numel():
            real = torch.arange(miss.numel(), device=miss.device) < n_unique
            wanted = [n_unique, (miss & real).sum()]
            if self._n_free < self._last_misses:  # it will likely evict: read how many can go
                masked = self._eviction_scores(policy.kept(slots, protected, reserved))
                wanted.append(policy.evictable(masked))
            u, n_miss, *rest = torch.stack(wanted).tolist()
            evictable = rest[0] if rest else None
        else:
            u, n_miss = 0, 0
        self._last_misses = n_miss
        uniq, counts, slots, miss = uniq[:u], counts[:u], slots[:u], miss[:u]
        if count:
            policy.record_uses(self.freq, uniq, counts)
            with self._lock:
                self.stats.rows_requested += u
                self.stats.hits += u - n_miss
        if n_miss:
            # the missing rows' positions, ascending (so are their rows: sorted host reads)
            at = torch.sort(miss.to(torch.uint8), descending=True, stable=True).indices[:n_miss]
            chosen = self._choose_slots(
                n_miss, slots, protected, reserved, prefetch, masked, evictable
            )
            if chosen is None:
                return None  # a prefetch that does not fit: the lookup will admit
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
                self._worker.submit(lambda: self._move(*job), job)
            else:
                self._move(*job)
        return Admitted(slots.index_select(0, inverse), slots, segments)

    def _count_admission(self) -> None:
        """A lookup's admission: every `age_every` of them, use counts halve (ageing)."""
        self._admissions += 1
        policy.age(self.freq, self._admissions, self.age_every)

    def _eviction_scores(self, keep: torch.Tensor) -> torch.Tensor:
        """[C]: each slot's score, inf for free slots and for `keep` (slots; -1 ignored)."""
        return policy.eviction_scores(self.score, self._free_slots, keep)

    def _choose_slots(
        self,
        n_miss: int,
        slots: torch.Tensor,
        protected: torch.Tensor | None,
        reserved: torch.Tensor | None,
        prefetch: bool,
        masked: torch.Tensor | None = None,
        evictable: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(`n_miss` slots for new rows, victims): free slots first, then the lowest-score
        slots outside this batch's `slots` [U] (-1 entries ignored), `protected` and
        `reserved`, evicted (victims, returned so dirty ones are written back; in bulk, so there
        may be more victims than needed: they join the free slots). None when they do not
        fit and this is only a prefetch. `masked`, `evictable`: the eviction scores of those
        slots and their finite count, when read already."""
        take = min(n_miss, self._n_free)
        free = self._free_slots[:take]
        short = n_miss - take
        if short == 0:
            self._free_slots = self._free_slots[take:]
            return free, free.new_empty(0)
        if masked is None or evictable is None:
            masked = self._eviction_scores(policy.kept(slots, protected, reserved))
            evictable = int(policy.evictable(masked))  # a second sync
        victims = policy.choose_victims(masked, short, evictable, self.evict_share)
        if victims is None:
            if prefetch:
                return None
            raise CacheTooSmallError(
                f"host cache of tables {self._names}: {self.capacity:,} rows cannot hold the "
                f"{slots.numel():,} distinct rows of one batch next to the rows still in use; "
                "raise sharding.cache_fraction or sharding.cache_gb, or lower train.batch_size"
            )
        self._evictions += 1
        self._free_slots = victims[short:]
        return torch.cat([free, victims[:short]]), victims

    @torch.no_grad()
    def reset_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """FusedEmbedding.reset_rows on the host rows and, where a row is cached, on its
        cached copy too (both then hold the fresh row: the slot is clean)."""
        self._wait()
        super().reset_rows(rows.to(self.weight.device), values.to(self.weight.device))
        slots = self.slot_of.index_select(0, rows).long()
        cached = (slots >= 0).nonzero().squeeze(1)
        if cached.numel():
            at = slots.index_select(0, cached)
            fresh = values.index_select(0, cached).to(self.cache_weight.dtype)
            self.cache_weight.index_copy_(0, at, fresh)
            for state in self.cache_state().values():
                state.index_fill_(0, at, 0.0)
            self.dirty.index_fill_(0, at, False)

    # -- keeping host memory canonical ----------------------------------------------------------
    @torch.no_grad()
    def flush(self) -> None:
        """Write every dirty cached row back to host memory (rows stay cached)."""
        self._wait()
        self._raise_if_broken()
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
        would have reached by now (policy.warm_counts). Returns the rows loaded.

        Also sets `warm_hits` (policy.warm_hits): the chance a row is among a step's ids,
        summed over the cached rows and over all rows; their ratio is the hit rate these rows
        give over a batch's distinct rows while the data looks like its counts."""
        self._wait()
        if frequency.shape != (self.num_rows,):
            raise ValueError(f"frequency must be [{self.num_rows}], got {list(frequency.shape)}")
        self.flush()
        self.slot_of.fill_(-1)
        self.row_of_slot.fill_(-1)
        self.dirty.zero_()
        self._reserved = None  # its slots are gone
        self._free_slots = torch.arange(self.capacity, device=self.device)
        n = policy.warm_size(frequency, self.capacity)
        if n == 0:
            return 0
        self.freq.copy_(policy.warm_counts(frequency, ids_per_step, self.age_every))
        top_dev = policy.warm_rows(self.freq, n)  # on the device: 188M rows
        self.warm_hits = policy.warm_hits(self.freq, top_dev, self.age_every)
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
        self._raise_if_broken()
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
