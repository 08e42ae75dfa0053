"""The sharded embedding collection: every table of the plan, spread over ranks, looking local.

    forward(ids [B_l, H]) -> pooled [B_l, T, D]    (B_l = this rank's slice of the global B)
                                                   ([B_l, sum_t D_t] when widths differ)

One step, the same stages at any world size, each handing the next a StepContext by value
(hybridrec.sparse.step): check ids (sparse.ids) -> `exchange.route` (the ids reach the
groups that own their shards) -> dynamic maps turn raw ids into rows (sparse.dynamic.remap)
-> one fused lookup per group (sparse.groups, sparse.fused) -> `exchange.deliver` (pooled rows
back to their samples, each feature rebuilt). The exchange is the all-to-all
(sparse.exchange.all_to_all: the identity on one rank), or on one rank whose one group holds
every table whole, the sample-major numbering (sparse.exchange.sample_major). Backward mirrors
it inside the all-to-all's autograd node in a fixed order on every rank, then each group
updates its rows with the whole global batch's gradients. The single-process reference
(hybridrec.sparse.collection.EmbeddingCollection) is this class on a one-rank plan.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from hybridrec import timing
from hybridrec.distributed.comm import CommStats, all_gather_rows, any_rank, world_size
from hybridrec.sparse.api import EmbeddingCounters, EmbeddingModule, IdCounts, ShardView, WarmStart
from hybridrec.sparse.dynamic.remap import map_raw_ids
from hybridrec.sparse.dynamic.stats import DynamicStats, dynamic_metrics
from hybridrec.sparse.exchange.all_to_all import AllToAll
from hybridrec.sparse.exchange.row_stats import RowStats
from hybridrec.sparse.exchange.sample_major import SampleMajor
from hybridrec.sparse.fused import RowOptimizer
from hybridrec.sparse.groups import Group, HostOptions, build_groups
from hybridrec.sparse.host import CacheStats, HostCachedEmbedding
from hybridrec.sparse.ids import ID_DTYPES, IdChecker, IdOutOfRangeError
from hybridrec.sparse.layout import GroupKey, Placement, ShardedLayout
from hybridrec.sparse.step import Exchange, GroupInput, StepContext, UnequalBatches, Wire
from hybridrec.types import Embedded, ShardingPlan, TableConfig


class ShardedEmbeddingCollection(EmbeddingModule):
    """This rank's part of every table, plus the exchanges that make it look local."""

    def __init__(
        self,
        tables: Sequence[TableConfig],
        plan: ShardingPlan,
        group: dist.ProcessGroup | None,
        optimizer: RowOptimizer | None,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        check_ids: bool = True,
        stats: CommStats | None = None,
        dtype: torch.dtype = torch.float32,
        host: HostOptions | None = None,
        comm_dtype: torch.dtype = torch.float32,
        autocast_output: bool = False,
        equal_batches: bool = False,
    ) -> None:
        """`autocast_output`: the model casts the pooled output to the autocast dtype before
        any other use (EmbeddingTables' declaration), so it may arrive in it (handoff_dtype).
        `equal_batches`: every rank feeds as many samples at every step (the trainer's loader
        pads to it), so no step shares its batch sizes first (see forward)."""
        super().__init__()
        self.equal_batches = equal_batches
        self.tables = list(tables)
        self.group, self.stats = group, stats
        # pooled embeddings and their gradients travel in this dtype (fp32: exact; bf16 or
        # fp16 halve the output dist's bytes, rounding what crosses; sums stay fp32)
        self.comm_dtype = comm_dtype
        world, rank = world_size(group), (dist.get_rank(group) if group is not None else 0)
        if plan.world_size != world:
            raise ValueError(f"plan is for {plan.world_size} ranks but the group has {world}")
        self.optimizer = optimizer
        self.layout = ShardedLayout.build(
            self.tables, plan, rank, optimizer is not None and optimizer.needs_full_row_stat
        )
        self.rank, self.world, self.plan = rank, world, plan
        self.device = torch.device(device)
        self.checker = IdChecker(self.tables) if check_ids else None
        built = build_groups(
            self.layout, optimizer, seed, self.device, dtype, host or HostOptions()
        )
        self.group_modules = nn.ModuleList(built)  # registered: .to(), train()/eval()
        self.groups: dict[GroupKey, Group] = {g.key: g for g in built}
        stores = {g.key: g.store for g in built}
        self.all_to_all = AllToAll(self.layout, stores, group, stats, self.device)
        key = self.layout.sample_major_group
        self.exchange: Exchange = (
            SampleMajor(self.layout, key, self.device) if key is not None else self.all_to_all
        )
        self.prefetches = self.layout.has_host
        self.autocast_output = autocast_output
        self._staged: StepContext | None = None

    # -- the interface the trainer and checkpoints use (hybridrec.sparse.api) ---------------
    def sparse_optimizers(self) -> list[RowOptimizer]:
        return [self.optimizer] if self.optimizer is not None else []

    def shard_views(self) -> list[ShardView]:
        """Every shard held here: (spec, weight view [rows, width], optimizer-state views); a
        dynamic shard's map arrays join its state as row-wise state (DynamicMap.views)."""
        out = []
        for group in self.groups.values():
            maps = dict(group.dynamic())
            for pos, (spec, weight, state) in enumerate(group.store.shard_views()):
                if pos in maps:
                    state = {**state, **maps[pos].views()}
                out.append((spec, weight, state))
        return out

    def replicated_tables(self) -> set[str]:
        return self.layout.replicated_tables

    @property
    def sparse_step(self) -> int:
        """The sparse optimizer's step count (the same in every group)."""
        counts = {g.store.step_count for g in self.groups.values()}
        assert len(counts) <= 1, f"fused groups disagree on their step count: {counts}"
        return counts.pop() if counts else 0

    def set_sparse_step(self, step: int) -> None:
        for g in self.groups.values():
            g.store.step_count = step
            for _, dmap in g.dynamic():  # a training step is one map step and one update
                dmap.set_clock(step)

    def check_inputs(self) -> None:
        """Raise, on every rank, for a bad id a deferred check met on any rank (collective)."""
        if self.checker is None:
            return
        local = self.checker.found()
        if any_rank(local, self.group, self.device, "id_check"):
            if local:
                self.checker.raise_recorded()
            raise IdOutOfRangeError(
                f"rank {self.rank}: another rank found an out-of-range id in a batch since the "
                "last check (that rank's error names the feature and the id)"
            )

    def host_groups(self) -> list[HostCachedEmbedding]:
        return [g.host for g in self.groups.values() if g.host is not None]

    def warm_start(self, counts: IdCounts, batch_size: int) -> WarmStart:
        """Fill each host cache with its most frequent rows: `counts(t)` gives feature t's id
        frequencies [num_rows] (None: unknown); a shared table adds its features'. (A dynamic
        table's rows have no counts: its ids are raw.)"""
        loaded = 0
        lay = self.layout
        for key, slots in lay.group_slots.items():
            cache = self.groups[key].host
            if cache is None or key.placement is not Placement.HOST:
                continue
            freq = torch.zeros(cache.num_rows, dtype=torch.float64)
            known, ids_per_step = False, 0.0
            for pos, (i, shard) in enumerate(slots):
                a = cache.offsets_list[pos]
                for f in (f for f, j in enumerate(lay.storage_of) if j == i):  # its features
                    table_counts = counts(f)
                    if table_counts is None:
                        continue
                    known = True
                    part = torch.from_numpy(table_counts[shard.row_start : shard.row_end])
                    freq[a : a + shard.num_rows] += part.double()
                    share = part.sum().item() / max(1, int(table_counts.sum()))
                    ids_per_step += batch_size * lay.tables[f].hotness * share
            if known:
                loaded += cache.warm_start(freq, ids_per_step)
        hits = [g.warm_hits for g in self.host_groups()]
        cached, total = sum(h[0] for h in hits), sum(h[1] for h in hits)
        return WarmStart(loaded, cached / total if total else None)

    def cache_stats(self) -> CacheStats | None:
        """This rank's host-cache counters since the last call (None: no host groups here)."""
        groups = self.host_groups()
        if not groups:
            return None
        total = CacheStats()
        for g in groups:
            total.add(g.take_stats())
        return total

    def take_metrics(self) -> EmbeddingCounters:
        """Counters since the last call: the host caches' (None when no rank holds a
        host-resident shard; zeros on a rank without any) and every dynamic table's of the
        plan (zeros where no shard is held here), so every rank sums the same fields."""
        held = self.dynamic_stats()
        dynamic = {t.name: held.get(t.name, DynamicStats()) for t in self.layout.storage
                   if t.dynamic is not None}  # fmt: skip
        cache = (self.cache_stats() or CacheStats()) if self.prefetches else None
        return EmbeddingCounters(cache, dynamic)

    def dynamic_stats(self) -> dict[str, DynamicStats]:
        """This rank's dynamic tables' counters since the last call, by table ({} if none)."""
        return dynamic_metrics([m for g in self.groups.values() for _, m in g.dynamic()])

    def take_eval_unknown(self) -> EmbeddingCounters:
        """Per dynamic table of the plan (zeros where no shard is held here, so every rank
        sums the same fields): ids looked up in evaluation since the last call, and those
        without a row (one column shard of a table counts)."""
        out = {t.name: DynamicStats() for t in self.layout.storage if t.dynamic is not None}
        for g in self.groups.values():
            for _, dmap in g.dynamic():
                ids, unknown = dmap.take_eval()
                if dmap.counts_table:
                    out[dmap.table.name].eval_ids += ids
                    out[dmap.table.name].eval_unknown += unknown
        return EmbeddingCounters(None, out)

    def prefetch(self, ids: torch.Tensor) -> StepContext | None:
        """Start moving the next batch's host-resident rows into the device caches.

        ids [B_l, H]: this rank's next batch. Collective when any rank holds host-resident
        shards (the ids travel by the exchange the forward then reuses), so every rank calls
        it at the same point: the pipeline does, between a step's forward and backward.
        Returns the batch's StepContext, with what each host group's prefetch admitted."""
        if not self.prefetches:
            return None
        with timing.phase("host_prefetch"):
            given = ids.to(self.device, non_blocking=True)
            step = self._route(*self._check_ids(given))
            prefetched = {  # the forward looks up these rows (a dynamic group's: not known yet)
                key: self.groups[key].host.prefetch(inp.rows)  # type: ignore[union-attr]
                for key, inp in step.lookups.items()
                if key.prefetched
            }
            return step.replace(given=given, given_version=given._version, prefetched=prefetched)

    def use_staged(self, staged: StepContext | None) -> None:
        self._staged = staged

    # -- forward ----------------------------------------------------------------------------
    def _check_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, IdOutOfRangeError | None]:
        """(ids, checked; this rank's error for a bad one). One rank raises it at once; with
        several, the bad ids read as 0 and the input dist tells every rank whether any rank
        found one (a flag in the exchange it makes anyway), so all fail together in that
        step, with no collective of their own (`_route`). Deferred on CUDA (IdChecker):
        bad ids read as 0 until check_inputs."""
        if ids.dtype != torch.int64 and ids.dtype in ID_DTYPES:
            ids = ids.long()  # narrower integer ids: the exchanges and maps work in int64
        if self.checker is None:
            return ids, None
        sample_base = self.rank * ids.shape[0]
        if self.checker.deferred(ids):
            return self.checker.sanitize(ids, sample_base=sample_base), None
        bad = self.checker.bad_mask(ids)
        if not bool(bad.any()):
            return ids, None
        error = self.checker.first_error(ids, bad, sample_base=sample_base)
        if self.world == 1:
            raise error
        return ids.masked_fill(bad, 0), error

    def _route(
        self, ids: torch.Tensor, error: IdOutOfRangeError | None, share_batch: bool = False
    ) -> StepContext:
        """The exchange's route of checked ids; raises, on every rank, if any rank found a
        bad one (`share_batch`: UnequalBatches first, if the ranks' B_l differ)."""
        at_once = self.checker is not None and not self.checker.deferred(ids)
        flag = (error is not None) if at_once else None  # deferred: no flag to read
        with timing.phase("input_dist"):
            step, flagged = self.exchange.route(ids, flag, share_batch)
        if error is not None:
            raise error
        if flagged:
            raise IdOutOfRangeError(
                f"rank {self.rank}: another rank found an out-of-range id in this batch "
                "(that rank's error names the feature and the id)"
            )
        return step

    def handoff_dtype(self, device: torch.device) -> torch.dtype | None:
        """The autocast dtype when the pooled embeddings go to the dense part in it: under
        autocast, with `autocast_output` (declared by the model: DLRM's dot interaction casts
        them first) and whole values on the wire (no row-wise partial sums still to add). The
        output dist then carries that dtype both ways, exactly; the 1/W scale is applied in
        fp32 after the backward exchange instead of before it: the same products. None:
        fp32."""
        if (
            self.autocast_output
            and self.layout.whole_values
            and not self.all_to_all.means
            and torch.is_autocast_enabled(device.type)
        ):
            return torch.get_autocast_dtype(device.type)
        return None

    def forward(self, ids: torch.Tensor) -> Embedded:
        """ids [B_l, H] int64 -> pooled [B_l, T, D] (or [B_l, sum D]; or each feature's
        [B_l, S_f, D] where the exchange builds them apart: Embedded) fp32 (or the hand-off
        dtype; jagged tables' columns padded with PAD_ID). Without `equal_batches`, several
        ranks first share their B_l (in the input dist's sizes exchange where it makes one, else a
        small all-gather): in training they must be equal (every rank raises, naming them),
        under no_grad any sizes work (padded, then cut)."""
        if self.world > 1 and not self.equal_batches and self._staged is None:
            if self.all_to_all.shares_batch:  # the sizes ride the input dist's own exchange
                try:
                    return self._embed(ids, share_batch=True)
                except UnequalBatches as unequal:
                    sizes = unequal.sizes
            else:
                sizes = self._batch_sizes(ids.shape[0])
            if len(set(sizes)) > 1:
                if torch.is_grad_enabled():
                    raise ValueError(
                        f"rank {self.rank}: the ranks' batches differ in size in training "
                        f"({', '.join(f'rank {r}: {n}' for r, n in enumerate(sizes))}); the "
                        "gradient is a mean over equal slices of the global batch: give every "
                        "rank the same number of samples (drop a last partial batch, or split "
                        "it evenly); evaluation under torch.no_grad() takes any sizes"
                    )
                padded = ids.new_zeros(max(sizes), ids.shape[1])  # id 0: in every table
                padded[: ids.shape[0]] = ids
                out = self._embed(padded)
                if isinstance(out, tuple):
                    return tuple(part[: ids.shape[0]] for part in out)
                return out[: ids.shape[0]]
        return self._embed(ids)

    def _batch_sizes(self, n: int) -> list[int]:
        """Every rank's B_l (a collective; reads them on the host)."""
        local = torch.tensor([n], dtype=torch.int64, device=self.device)
        return all_gather_rows(local, self.group, name="batch_sizes").tolist()

    def _embed(self, ids: torch.Tensor, share_batch: bool = False) -> Embedded:
        """forward, once every rank holds as many samples (see forward; `share_batch`: the
        route checks it, raising UnequalBatches): the step's stages in order (module
        docstring), each handing the next the StepContext."""
        step = self._staged_or_routed(ids, share_batch)
        if self.layout.dynamic:
            with timing.phase("dynamic_map"):
                step = map_raw_ids(step, self.groups, self.training and torch.is_grad_enabled())
        row_stats = RowStats() if self.layout.exchange_row_stats else None
        step = step.replace(wire=self._wire(step.ids.device), row_stats=row_stats)
        with timing.phase("lookup"):
            pooled = {key: self._lookup(key, inp, step) for key, inp in step.lookups.items()}
        return self.exchange.deliver(pooled, step)

    def _staged_or_routed(self, ids: torch.Tensor, share_batch: bool = False) -> StepContext:
        """What prefetch() staged for this batch (checked to be these ids), or the ids
        checked and routed now."""
        staged, self._staged = self._staged, None
        if staged is None:  # ids may come from the host (a no-op when on the device already)
            checked = self._check_ids(ids.to(self.device, non_blocking=True))
            return self._route(*checked, share_batch=share_batch)
        if not staged.matches(ids):
            raise RuntimeError(
                "the staged batch does not match the forward's ids: prefetch() was given "
                "another batch than the one this forward runs on"
            )
        return staged

    def _wire(self, device: torch.device) -> Wire:
        """How this step's pooled rows cross (the hand-off dtype under autocast, see
        handoff_dtype; else the comm dtype, back to fp32 on arrival)."""
        handoff = self.handoff_dtype(device)
        if handoff is None:
            return Wire(self.comm_dtype)
        return Wire(handoff, keep=True, scale=1.0 / self.world)

    def _lookup(self, key: GroupKey, inp: GroupInput, step: StepContext) -> torch.Tensor:
        """Group `key`'s pooled rows [num_bags, w] of its lookup `inp` (its backward updates
        the rows; column shards read their row statistics from the step's RowStats)."""
        row_sq = None
        if step.row_stats is not None and any(
            k in self.layout.peers for k in self.layout.group_units[key]
        ):
            row_sq = functools.partial(step.row_stats.take, key)
        wire = step.wire
        out_dtype = wire.dtype if wire.keep and self.exchange.pools_in_handoff else torch.float32
        return self.groups[key].store.lookup(
            inp.rows, inp.bags, inp.scale, inp.num_bags, out_dtype,
            row_sq=row_sq, prefetched=step.prefetched.get(key),
        )  # fmt: skip
