"""DynamicMap: one shard's raw id -> slot map of a dynamic table, with its policy's state.

A dynamic table of R rows has `buckets` fixed hash buckets of S = R / buckets slots; bucket
b owns rows [b*S, (b+1)*S). A shard owns whole buckets [b0, b1) (rows [b0*S, b1*S)), and its
map holds, per slot (local row r = (b - b0) * S + j):

    slot_id [R_s] int64   the raw id in the slot, -1: free
    score   [R_s] fp32    LFU use count (halving every `halflife` steps)
    last    [R_s] int64   the step the slot was last used (LRU, TTL)

    admits, evicts [R_s] int64   ids the slot was given, ids evicted from it (the totals)

plus the count policy's candidates (ids not admitted yet and their counts, at most S per
bucket: the S highest counts, ties to the smaller id), the step clock and the counters. Each
bucket's free positions are listed (`free`, `n_free`), and an index answers lookups: on the
CPU a hash table in C (kernels/native_map.py, which also runs `step`), else a sorted copy of
the occupied ids (`keys`, `key_slots`, with a small sorted delta of recent admissions:
`_update_keys`) searched in torch ops (the Triton probe on CUDA). Both paths make the same
decisions; the free lists and indexes are derived from `slot_id` (rebuilt on load, and an
index when the other path changed the slots), never saved.

Checkpoints: `views()` gives every per-slot array, and the candidates packed per slot (bucket
b's at most S candidates in its rows, by id: `cand_id` -1 where none, `cand_count`), as
row-wise state: they are saved, loaded and resharded with the shard's rows (whole buckets).
A view may be written (a load): the map reads the candidates back and rebuilds its keys
before its next use. The clock is the sparse optimizer's step (set_clock, from the
checkpoint's step count: one training step = one map step and one update).

With `unknown="row"` the last slot of each bucket (j = S - 1) is that bucket's shared
"unknown" row: never given to an id, looked up (and trained) by the bucket's ids that have
no slot; ids then get S - 1 slots per bucket. With "zeros" an id without a slot is left out
of its bag (it adds zero and gets no gradient).

`step(ids)` (training, once per step over every id of the table the shard serves in that
step) records uses, admits and evicts, and returns the slots; `find(ids)` (evaluation and
inference) only looks up. Decisions read only each bucket's ids (policy.py), so any world
size decides the same as one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridrec.kernels import hashing, native_map
from hybridrec.kernels.probe import probe
from hybridrec.sparse.costs import index_entries
from hybridrec.sparse.dynamic import policy
from hybridrec.sparse.dynamic.check import slot_id_problem
from hybridrec.types import Dynamic, ShardSpec, TableConfig

# a full bucket's eviction frees at least this share of its slots (the rest of the victims
# become free slots), so it is not scanned again for the next admissions (policy.choose_slots)
EVICT_SHARE = 1 / 16


@dataclass
class DynamicCounters:
    """Since the last `take_counters()`: ids admitted, ids evicted, steps; ids looked up
    without grad (evaluation) and how many of them had no slot."""

    admitted: int = 0
    evicted: int = 0
    steps: int = 0
    eval_ids: int = 0
    eval_unknown: int = 0


@dataclass(frozen=True)
class Stepped:
    """What `DynamicMap.step` did: slots [N] of the ids (-1: none), and the slots it gave new
    ids [A] with those ids [A] (their rows must start fresh before the lookup)."""

    slots: torch.Tensor
    new_slots: torch.Tensor
    new_ids: torch.Tensor


class DynamicMap(nn.Module):
    """The id -> slot map of one shard (whole buckets) of a dynamic table (see module doc)."""

    def __init__(
        self,
        table: TableConfig,
        table_index: int,
        shard: ShardSpec,
        seed: int,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        assert table.dynamic is not None
        pol: Dynamic = table.dynamic
        self.policy, self.table, self.table_index, self.seed = pol, table, table_index, seed
        self.S = table.num_rows // pol.buckets
        if shard.row_start % self.S or shard.num_rows % self.S:
            raise ValueError(
                f"dynamic table {table.name!r}: shard rows [{shard.row_start}, {shard.row_end}) "
                f"do not fall on its buckets of {self.S} rows; row-wise shards of a dynamic "
                "table must own whole buckets (plan it with hybridrec's planner)"
            )
        self.b0, self.nb = shard.row_start // self.S, shard.num_rows // self.S
        self.ids_per_bucket = self.S - pol.reserved_rows
        self.bulk = max(1, int(self.ids_per_bucket * EVICT_SHARE))  # an eviction's least victims
        self.col_start, self.col_end = shard.col_start, shard.col_end
        # counters and ratios count a table once: its first column shard
        self.counts_table = shard.col_start == 0
        R = shard.num_rows
        device = torch.device(device)
        self.register_buffer("slot_id", torch.full((R,), -1, dtype=torch.int64, device=device))
        self.register_buffer("score", torch.zeros(R, dtype=torch.float32, device=device))
        self.register_buffer("last", torch.zeros(R, dtype=torch.int64, device=device))
        self.register_buffer("admits", torch.zeros(R, dtype=torch.int64, device=device))
        self.register_buffer("evicts", torch.zeros(R, dtype=torch.int64, device=device))
        self.register_buffer("cand_id", torch.full((R,), -1, dtype=torch.int64, device=device))
        self.register_buffer("cand_count", torch.zeros(R, dtype=torch.int64, device=device))
        self.clock = 0
        self.cand_ids = torch.zeros(0, dtype=torch.int64, device=device)
        self.cand_counts = torch.zeros(0, dtype=torch.int64, device=device)
        self._viewed = False  # views() handed out: they may have been written
        self.counters = DynamicCounters()
        self._admit_key = hashing.table_key(seed, table_index, hashing.ADMIT_SALT)
        self._busy: torch.Tensor | None = None  # the C path's marks of this step's slots
        self._rebuild()

    # -- the sorted index ------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """The free lists from the slots, and the indexes marked stale (on load)."""
        self._rebuild_free()
        self._keys_ok = False  # the torch path's sorted index
        self._native: native_map.NativeIndex | None = None  # the C path's hash index

    def _torch_index(self) -> None:
        """The sorted index, rebuilt if the C path changed the slots since it was made."""
        if not self._keys_ok:
            self._rebuild_keys()
            self._keys_ok = True

    def _native_index(self) -> native_map.NativeIndex:
        """The C path's index, rebuilt if the torch path changed the slots since."""
        if self._native is None:
            self._native = native_map.NativeIndex(self.slot_id, index_entries(self.slot_id.numel()))
        return self._native

    def _rebuild_keys(self) -> None:
        """The sorted index of the held ids (keys [n] ascending, key_slots [n] their slots),
        its delta emptied."""
        occupied = (self.slot_id >= 0).nonzero().squeeze(1)
        keys, order = torch.sort(self.slot_id.index_select(0, occupied))
        self.keys, self.key_slots = keys, occupied.index_select(0, order)
        self.delta_keys = self.delta_slots = keys.new_zeros(0)
        self.dead = 0

    def _update_keys(self, gone: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """The index without the ids `gone` (held), with `ids` (not held) in `slots`. Like a
        log-structured merge: a gone id of the sorted keys is marked dead in place (its slot
        -1), new ids join a small sorted delta; when the delta and the dead outgrow a quarter
        of the keys, the index is rebuilt. Each step costs O(delta + ids log keys)."""
        n = self.keys.numel()
        if gone.numel() and n:
            pos = torch.searchsorted(self.keys, gone).clamp_(max=n - 1)
            alive = (self.keys.index_select(0, pos) == gone) & (
                self.key_slots.index_select(0, pos) >= 0
            )
            self.key_slots.index_fill_(0, pos[alive], -1)
            self.dead += int(alive.sum())
            gone = gone[~alive]
        if gone.numel():  # held in the delta
            keep = ~torch.isin(self.delta_keys, gone)
            self.delta_keys, self.delta_slots = self.delta_keys[keep], self.delta_slots[keep]
        keys, order = torch.sort(torch.cat([self.delta_keys, ids]))
        self.delta_keys = keys
        self.delta_slots = torch.cat([self.delta_slots, slots]).index_select(0, order)
        if self.delta_keys.numel() + self.dead > max(1024, n // 4):
            self._rebuild_keys()

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """[N] the slot of each raw id (-1: none): on the CPU the C path's hash index, else
        binary searches of the sorted keys and their delta (the Triton probe on CUDA,
        hybridrec.kernels.probe). Changes nothing."""
        self._reload()
        if native_map.usable(self.slot_id):
            return self._native_index().find(ids)
        return self._find_sorted(ids)

    def _find_sorted(self, ids: torch.Tensor) -> torch.Tensor:
        self._torch_index()
        found = probe(self.keys, self.key_slots, ids)
        if self.delta_keys.numel():
            found = torch.where(found >= 0, found, probe(self.delta_keys, self.delta_slots, ids))
        return found

    def bucket_local(self, ids: torch.Tensor) -> torch.Tensor:
        """[N] each id's bucket, counted from this shard's first (0 <= b < nb for its ids)."""
        return hashing.bucket_of(ids, self.policy.buckets) - self.b0

    # -- training ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> Stepped:
        """One training step's ids [N] (every feature of the table, every source rank):
        record uses, admit and evict per the policy, return the slots (see Stepped). On the
        CPU in C (kernels/native_map.py), else in torch ops: the same decisions."""
        self._reload()
        self.clock += 1
        self.counters.steps += 1
        if native_map.usable(self.slot_id):
            stepped = self._step_native(ids)
        else:
            stepped = self._step_torch(ids)
        if self.policy.evict == "lfu":
            policy.age(self.score, self.clock, self.policy.halflife)
        return stepped

    def _step_native(self, ids: torch.Tensor) -> Stepped:
        pol, index = self.policy, self._native_index()
        if self._busy is None:
            self._busy = torch.zeros(self.slot_id.numel(), dtype=torch.int8)
        used = native_map.uses(
            ids, index, self.clock, pol.evict == "lfu", self.score, self.last, self._busy
        )
        misses = used.miss_ids
        want, totals = self._admissible(misses, used.counts.index_select(0, used.miss_u))
        want_u = used.miss_u
        if want.numel() != misses.numel():  # want: some of the misses, ascending as they are
            want_u = want_u.index_select(0, torch.searchsorted(misses, want))
        state = {
            "slot_id": self.slot_id, "score": self.score, "last": self.last,
            "admits": self.admits, "evicts": self.evicts, "free": self.free,
            "n_free": self.n_free, "busy": self._busy,
        }  # fmt: skip
        done = native_map.admit(
            want, want_u, used.counts.index_select(0, want_u), used.slots, state, index,
            (self.S, self.ids_per_bucket, self.nb, self.b0, pol.buckets), self.clock,
            pol.evict, pol.ttl_steps, self.bulk,
        )  # fmt: skip
        if pol.admit == "count" and bool(done.left.any()):  # as in _step_torch
            self._add_candidates(want[done.left], totals[done.left])
        if done.new_slots.numel() or done.evicted:
            self._keys_ok = False
        self.counters.admitted += done.new_slots.numel()
        self.counters.evicted += done.evicted
        return Stepped(used.slots.index_select(0, used.inverse), done.new_slots, done.new_ids)

    def _step_torch(self, ids: torch.Tensor) -> Stepped:
        t, pol = self.clock, self.policy
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        slots = self._find_sorted(uniq)
        hit = slots >= 0
        hit_slots = slots[hit]
        if pol.evict == "lfu":
            policy.record_uses(self.score, hit_slots, counts[hit])
        self.last.index_fill_(0, hit_slots, t)
        miss = (~hit).nonzero().squeeze(1)
        want, totals = self._admissible(uniq.index_select(0, miss), counts.index_select(0, miss))
        new_slots = new_ids = ids.new_zeros(0)
        if want.numel():
            pos = miss.index_select(0, torch.searchsorted(uniq.index_select(0, miss), want))
            got, extra = self._assign(want, hit_slots)
            gone = self._evict(extra) if extra.numel() else extra
            ok = got >= 0
            new_slots, new_ids = got[ok], want[ok]
            if pol.admit == "count":  # admitted by count but left without a slot: still counted
                left = ~ok
                if bool(left.any()):
                    self._add_candidates(want[left], totals[left])
            if new_slots.numel():
                victims = self.slot_id.index_select(0, new_slots)
                evicted = (victims >= 0).long()
                n_evicted = int(evicted.sum())
                self.admits.index_add_(0, new_slots, torch.ones_like(new_slots))
                self.evicts.index_add_(0, new_slots, evicted)
                self.slot_id.index_copy_(0, new_slots, new_ids)
                self.score.index_copy_(0, new_slots, counts.index_select(0, pos[ok]).float())
                self.last.index_fill_(0, new_slots, t)
                slots.index_copy_(0, pos[ok], new_slots)
                self.counters.admitted += new_slots.numel()
                self.counters.evicted += n_evicted
                self._update_keys(torch.cat([gone, victims[victims >= 0]]), new_ids, new_slots)
                self._native = None
            elif gone.numel():
                self._update_keys(gone, new_ids, new_slots)
                self._native = None
        return Stepped(slots.index_select(0, inverse), new_slots, new_ids)

    def _admissible(
        self, ids: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the missed ids [M] (ascending, this step's counts [M]) the policy admits now,
        ascending; their counts so far). The count policy adds this step's counts to its
        candidates' and admits those of this step whose count reached min_count."""
        pol = self.policy
        if pol.admit == "always" or ids.numel() == 0:
            return ids, counts
        if pol.admit == "probability":
            ok = hashing.uniform_of(ids, self._admit_key) < pol.probability
            return ids[ok], counts[ok]
        merged, total = policy.merge_counts(self.cand_ids, self.cand_counts, ids, counts)
        ready = (total >= pol.min_count) & torch.isin(merged, ids)
        self._set_candidates(merged[~ready], total[~ready])
        return merged[ready], total[ready]

    def _add_candidates(self, ids: torch.Tensor, counts: torch.Tensor) -> None:
        merged, total = policy.merge_counts(self.cand_ids, self.cand_counts, ids, counts)
        self._set_candidates(merged, total)

    def _set_candidates(self, ids: torch.Tensor, counts: torch.Tensor) -> None:
        """Keep at most S candidates per bucket (policy.bound_candidates)."""
        self.cand_ids, self.cand_counts = policy.bound_candidates(
            ids, counts, self.bucket_local(ids), self.S
        )

    def _assign(
        self, want: torch.Tensor, busy_slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([A] the slot each id of `want` (ascending) takes, -1 for none; the slots an
        eviction freed beyond those: policy.choose_slots); `busy_slots`: slots used by this
        step, never evicted in it."""
        pol, S, Sw = self.policy, self.S, self.ids_per_bucket
        buckets = self.bucket_local(want)

        def priorities(touched: torch.Tensor) -> torch.Tensor:
            busy = torch.zeros_like(self.slot_id, dtype=torch.bool).index_fill_(0, busy_slots, True)

            def rows(x: torch.Tensor) -> torch.Tensor:
                return x.view(self.nb, S)[:, :Sw].index_select(0, touched)

            return policy.slot_priorities(
                rows(self.slot_id), rows(self.score), rows(self.last), rows(busy),
                pol.evict, self.clock, pol.ttl_steps,
            )  # fmt: skip

        j, ex_bucket, ex_pos = policy.choose_slots(
            buckets, self.free, self.n_free, priorities, self.bulk
        )
        return torch.where(j >= 0, buckets * S + j, -1), ex_bucket * S + ex_pos

    def _evict(self, slots: torch.Tensor) -> torch.Tensor:
        """Free `slots` (held; an eviction's extra victims); returns their ids."""
        gone = self.slot_id.index_select(0, slots)
        self.slot_id.index_fill_(0, slots, -1)
        self.score.index_fill_(0, slots, 0.0)
        self.last.index_fill_(0, slots, 0)
        self.evicts.index_add_(0, slots, torch.ones_like(slots))
        self.counters.evicted += slots.numel()
        return gone

    def _rebuild_free(self) -> None:
        """Each bucket's free positions (policy.free_lists), from the slots."""
        view = self.slot_id.view(self.nb, self.S)[:, : self.ids_per_bucket]
        self.free, self.n_free = policy.free_lists(view)

    # -- ids without a slot ------------------------------------------------------------------
    def resolve(
        self, ids: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows [N'], kept [N'] positions or None): slots of ids [N] with the ids without one
        sent to their bucket's unknown row ("row": N' = N, kept None) or left out ("zeros":
        kept = the positions of the ids with a slot)."""
        missing = slots < 0
        if self.policy.unknown == "row":
            unknown_row = self.policy.unknown_row(self.bucket_local(ids), self.S)
            return torch.where(missing, unknown_row, slots), None
        kept = (~missing).nonzero().squeeze(1)
        if kept.numel() == slots.numel():
            return slots, None
        return slots.index_select(0, kept), kept

    def count_eval(self, slots: torch.Tensor) -> None:
        """Count an evaluation lookup's ids and those without a slot."""
        self.counters.eval_ids += slots.numel()
        self.counters.eval_unknown += int((slots < 0).sum())

    # -- fresh rows -------------------------------------------------------------------------------
    def fresh_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[K, shard width] the initial rows of ids [K] (hashing.fresh_rows)."""
        return hashing.fresh_rows(
            ids,
            self.seed,
            self.table_index,
            self.table.num_rows,
            self.col_start,
            self.col_end,
            dtype,
        )

    # -- stats and state ------------------------------------------------------------------------
    def occupancy(self) -> tuple[int, int]:
        """(slots holding an id, slots ids may take)."""
        return int((self.slot_id >= 0).sum()), self.nb * self.ids_per_bucket

    def take_eval(self) -> tuple[int, int]:
        """(ids looked up in evaluation, of which without a row) since the last call."""
        c = self.counters
        out = (c.eval_ids, c.eval_unknown)
        c.eval_ids = c.eval_unknown = 0
        return out

    def take_counters(self) -> DynamicCounters:
        out, self.counters = self.counters, DynamicCounters()
        return out

    @property
    def admitted_total(self) -> int:
        return int(self.admits.sum())

    @property
    def evicted_total(self) -> int:
        return int(self.evicts.sum())

    def set_clock(self, step: int) -> None:
        """The step clock after `step` training steps (a checkpoint's sparse step count)."""
        self.clock = int(step)

    @torch.no_grad()
    def views(self) -> dict[str, torch.Tensor]:
        """Every per-slot array by checkpoint name (see the module doc), the candidates packed
        into `cand_id` / `cand_count` first; writes into them take effect at the next use."""
        self._reload()
        self.cand_id.fill_(-1)
        self.cand_count.zero_()
        if self.cand_ids.numel():
            buckets = self.bucket_local(self.cand_ids)
            order = torch.sort(buckets, stable=True).indices  # by bucket, then id
            at = buckets * self.S + policy.rank_in_bucket(buckets, order)
            self.cand_id.index_copy_(0, at, self.cand_ids)
            self.cand_count.index_copy_(0, at, self.cand_counts)
        self._viewed = True
        return {
            "dyn_slot_id": self.slot_id,
            "dyn_score": self.score,
            "dyn_last": self.last,
            "dyn_admits": self.admits,
            "dyn_evicts": self.evicts,
            "dyn_cand_id": self.cand_id,
            "dyn_cand_count": self.cand_count,
        }

    def _reload(self) -> None:
        """After views() were handed out: read the candidates back, rebuild the keys."""
        if not self._viewed:
            return
        self._viewed = False
        held = (self.cand_id >= 0).nonzero().squeeze(1)
        ids = self.cand_id.index_select(0, held)
        order = torch.sort(ids).indices
        self.cand_ids = ids.index_select(0, order)
        self.cand_counts = self.cand_count.index_select(0, held).index_select(0, order)
        self._rebuild()

    def get_extra_state(self) -> dict:
        return {
            "clock": self.clock,
            "cand_ids": self.cand_ids.cpu(),
            "cand_counts": self.cand_counts.cpu(),
        }

    def set_extra_state(self, state: dict) -> None:
        """load_state_dict's last step (the buffers are loaded by then): the clock and the
        candidates; ValueError naming the table when the loaded slot ids break the map's
        invariants (sparse.dynamic.check), before an index is built on them."""
        device = self.slot_id.device
        self.clock = int(state["clock"])
        self.cand_ids = state["cand_ids"].to(device)
        self.cand_counts = state["cand_counts"].to(device)
        self._viewed = False
        R, start = self.slot_id.numel(), self.b0 * self.S
        problem = slot_id_problem(self.slot_id.cpu(), self.policy, self.table.num_rows, start, R)
        if problem:
            raise ValueError(
                f"dynamic table {self.table.name!r}: the state dict loaded into its map (rows "
                f"{start}:{start + R}) does not fit its policy: {problem}"
            )
        self._rebuild()
