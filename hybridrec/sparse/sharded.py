"""The sharded embedding collection: every table of the plan, spread over ranks, looking local.

    forward(ids [B_l, H]) -> pooled [B_l, T, D]    (B_l = this rank's slice of the global B)
                                                   ([B_l, sum_t D_t] when widths differ)

One step, each stage in its own module: check ids (hybridrec.sparse.ids) -> input dist
(sparse.exchange.input) -> one fused lookup per width group (sparse.local, sparse.fused) -> output
dist and reassembly (sparse.exchange.output); replicated tables pool locally (sparse.exchange.
replicated). Backward mirrors it inside the output dist's autograd node, in a fixed order on
every rank: all-to-all in reverse, row statistics of column shards (sparse.exchange.row_stats),
replicated tables' sync; then each group updates its rows with the whole global batch's
gradients. The output is scaled by 1/W in backward (gradient-scaling rule: docs/architecture.md).

One rank, with or without a process group, runs this same code: its exchanges are the
identity, and a lone group holding every table whole looks up sample-major (sparse.local).
The single-process reference (hybridrec.sparse.collection.EmbeddingCollection) is this class
on a one-rank plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hybridrec import timing
from hybridrec.distributed.comm import CommStats, ScaleGrad, all_gather_rows, any_rank, world_size
from hybridrec.sparse.api import EmbeddingModule, IdCounts, ShardView, WarmStart
from hybridrec.sparse.bags import divide_means, jagged_means, mean_divisors
from hybridrec.sparse.dynamic.remap import build_maps, column_maps, remap, remap_columns
from hybridrec.sparse.dynamic.stats import DynamicStats, dynamic_metrics
from hybridrec.sparse.exchange.input import Routed, build_routes, input_dist
from hybridrec.sparse.exchange.output import output_dist, reassemble
from hybridrec.sparse.exchange.replicated import ReplicaInputs, replicated_lookup, sync_replicas
from hybridrec.sparse.exchange.row_stats import RowStats, share_row_stats
from hybridrec.sparse.fused import RowOptimizer
from hybridrec.sparse.host import CacheStats, HostCachedEmbedding, Prefetched
from hybridrec.sparse.ids import IdChecker, IdOutOfRangeError
from hybridrec.sparse.layout import ShardedLayout
from hybridrec.sparse.local import (
    HostOptions,
    SampleMajorInputs,
    build_groups,
    lookup_groups,
    lookup_sample_major,
    sample_major_inputs,
    sample_major_layout,
)
from hybridrec.types import ShardingPlan, TableConfig


@dataclass(frozen=True)
class Staged:
    """A batch's ids, checked, with what prefetch() computed for them: the input dist
    (several ranks) or the sample-major lookup inputs (one rank), and per host group what
    its prefetch admitted (group key -> Prefetched), handed to its lookup of those rows."""

    ids: torch.Tensor
    routed: Routed | None
    sample_major: SampleMajorInputs | None
    prefetched: dict[str, Prefetched]


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
        self.routes = build_routes(self.layout, self.device)
        self.checker = IdChecker(self.tables) if check_ids else None
        self.means = jagged_means(self.tables)  # divided by bag lengths after the exchange
        self.groups = build_groups(
            self.layout, optimizer, seed, self.device, dtype, host or HostOptions()
        )
        # dynamic shards' id -> row maps, by group key (hybridrec.sparse.dynamic)
        self.dynamic = nn.ModuleDict(build_maps(self.layout, seed, self.device))
        key = self.layout.sample_major_group
        self.sample_major = None
        self.column_maps = []
        if key is not None:
            group = self.groups[key]
            units = [self.layout.local_units[k] for k in self.layout.group_units[key]]
            start = {  # feature -> where its table's rows start in the group
                u.table_index: group.offsets_list[p]
                for u, p in zip(units, self.layout.input_slots(key), strict=True)
            }
            offsets = [start[f] for f in range(len(self.tables))]
            self.sample_major = sample_major_layout(self.tables, offsets, self.device)
            # its dynamic tables' columns become rows first (an id without one: PAD_ID)
            self.column_maps = column_maps(self.layout, group, self.device)
            if any(self.dynamic[c.key].policy.unknown == "zeros" for c in self.column_maps):
                self.sample_major = dataclasses.replace(self.sample_major, jagged=True)
        self.prefetches = self.layout.has_host
        self.autocast_output = autocast_output
        self._staged: Staged | None = None

    # -- the interface the trainer and checkpoints use (hybridrec.sparse.api) ---------------
    def sparse_optimizers(self) -> list[RowOptimizer]:
        return [self.optimizer] if self.optimizer is not None else []

    def shard_views(self) -> list[ShardView]:
        """Every shard held here: (spec, weight view [rows, width], optimizer-state views); a
        dynamic shard's map arrays join its state as row-wise state (DynamicMap.views)."""
        out = []
        for key, group in self.groups.items():
            views = group.shard_views()
            for pos, (spec, weight, state) in enumerate(views):
                for k in (key, f"{key}_t{pos}"):  # (the sample-major group's: "<key>_t<pos>")
                    if k in self.dynamic:
                        state = {**state, **self.dynamic[k].views()}
                out.append((spec, weight, state))
        return out

    def replicated_tables(self) -> set[str]:
        return self.layout.replicated_tables

    @property
    def sparse_step(self) -> int:
        """The sparse optimizer's step count (the same in every group)."""
        counts = {g.step_count for g in self.groups.values()}
        assert len(counts) <= 1, f"fused groups disagree on their step count: {counts}"
        return counts.pop() if counts else 0

    def set_sparse_step(self, step: int) -> None:
        for g in self.groups.values():
            g.step_count = step
        for m in self.dynamic.values():  # a training step is one map step and one update
            m.set_clock(step)

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
        return [g for g in self.groups.values() if isinstance(g, HostCachedEmbedding)]

    def warm_start(self, counts: IdCounts, batch_size: int) -> WarmStart:
        """Fill each host cache with its most frequent rows: `counts(t)` gives feature t's id
        frequencies [num_rows] (None: unknown); a shared table adds its features'."""
        loaded = 0
        lay = self.layout
        for key, slots in lay.group_slots.items():
            group = self.groups[key]
            if not isinstance(group, HostCachedEmbedding) or key in self.dynamic:
                continue  # (a dynamic table's rows have no counts: its ids are raw)
            freq = torch.zeros(group.num_rows, dtype=torch.float64)
            known, ids_per_step = False, 0.0
            for pos, (i, shard) in enumerate(slots):
                a = group.offsets_list[pos]
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
                loaded += group.warm_start(freq, ids_per_step)
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

    def take_metrics(self) -> dict[str, float]:
        """The host-cache counters as `cache.<name>` ({} when no rank has host groups; zeros
        on a rank without any, so every rank sums the same keys)."""
        out = {}
        if self.layout.dynamic:  # every rank sums the same keys (zeros where none is held)
            held = self.dynamic_stats()
            for t in self.layout.storage:
                if t.dynamic is not None:
                    st = held.get(t.name, DynamicStats())
                    out.update({f"dynamic.{t.name}.{k}": float(v) for k, v in st.items()})
        if not self.prefetches:
            return out
        st = self.cache_stats() or CacheStats()
        out.update({f"cache.{k}": float(v) for k, v in dataclasses.asdict(st).items()})
        return out

    def dynamic_stats(self) -> dict[str, DynamicStats]:
        """This rank's dynamic tables' counters since the last call, by table ({} if none)."""
        return dynamic_metrics(self.dynamic)

    def take_eval_unknown(self) -> dict[str, float]:
        """Per dynamic table of the plan (zeros where no shard is held here, so every rank
        sums the same keys): ids looked up in evaluation since the last call, and those
        without a row (one column shard of a table counts)."""
        out = {}
        for t in self.layout.storage:
            if t.dynamic is not None:
                out[f"{t.name}.ids"] = out[f"{t.name}.unknown"] = 0.0
        for dmap in self.dynamic.values():
            ids, unknown = dmap.take_eval()
            if dmap.counts_table:
                out[f"{dmap.table.name}.ids"] += ids
                out[f"{dmap.table.name}.unknown"] += unknown
        return out

    def prefetch(self, ids: torch.Tensor) -> Staged | None:
        """Start moving the next batch's host-resident rows into the device caches.

        ids [B_l, H]: this rank's next batch. Collective when any rank holds host-resident
        shards (the ids travel by the input dist the forward then reuses), so every rank
        calls it at the same point: the pipeline does, between a step's forward and backward."""
        if not self.prefetches:
            return None
        with timing.phase("host_prefetch"):
            clean, error = self._check_ids(ids.to(self.device, non_blocking=True))
            if self.sample_major is not None:  # the forward looks up these rows
                inputs = sample_major_inputs(clean, self.sample_major)
                [(key, group)] = self.groups.items()
                return Staged(clean, None, inputs, {key: group.prefetch(inputs.rows)})
            routed = self._input_dist(clean, error)
            prefetched = {  # the forward looks up these rows (a dynamic group's: not known yet)
                key: group.prefetch(routed.groups[key].rows)
                for key, group in self.groups.items()
                if isinstance(group, HostCachedEmbedding) and key not in self.dynamic
            }
            return Staged(clean, routed, None, prefetched)

    def use_staged(self, staged: Staged | None) -> None:
        self._staged = staged

    # -- forward ----------------------------------------------------------------------------
    def _check_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, IdOutOfRangeError | None]:
        """(ids, checked; this rank's error for a bad one). One rank raises it at once; with
        several, the bad ids read as 0 and the input dist tells every rank whether any rank
        found one (a flag in the exchange it makes anyway), so all fail together in that
        step, with no collective of their own (`_input_dist`). Deferred on CUDA (IdChecker):
        bad ids read as 0 until check_inputs."""
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

    def _input_dist(self, ids: torch.Tensor, error: IdOutOfRangeError | None) -> Routed:
        """The input dist of checked ids; raises, on every rank, if any rank found a bad one."""
        at_once = self.checker is not None and not self.checker.deferred(ids)
        flag = (error is not None) if at_once else None  # deferred: no flag to read
        routed = input_dist(ids, self.layout, self.routes, self.group, self.stats, flag=flag)
        if error is not None:
            raise error
        if routed.flagged:
            raise IdOutOfRangeError(
                f"rank {self.rank}: another rank found an out-of-range id in this batch "
                "(that rank's error names the feature and the id)"
            )
        return routed

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
            and not self.means
            and torch.is_autocast_enabled(device.type)
        ):
            return torch.get_autocast_dtype(device.type)
        return None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B_l, H] int64 -> pooled [B_l, T, D] (or [B_l, sum D]) fp32 (or the hand-off
        dtype; jagged tables' columns padded with PAD_ID). Without `equal_batches`, several
        ranks first share their B_l (a small all-gather): in training they must be equal
        (every rank raises, naming them), under no_grad any sizes work (padded, then cut)."""
        if self.world > 1 and not self.equal_batches and self._staged is None:
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
                return self._pooled(padded)[: ids.shape[0]]
        return self._pooled(ids)

    def _batch_sizes(self, n: int) -> list[int]:
        """Every rank's B_l (a collective; reads them on the host)."""
        local = torch.tensor([n], dtype=torch.int64, device=self.device)
        return all_gather_rows(local, self.group, name="batch_sizes").tolist()

    def _pooled(self, ids: torch.Tensor) -> torch.Tensor:
        """forward, once every rank holds as many samples (see forward)."""
        staged, self._staged = self._staged, None
        error = None
        if staged is not None:
            if staged.ids.shape != ids.shape:
                raise RuntimeError("the staged batch does not match the forward's ids")
            ids = staged.ids  # checked (and distributed) by prefetch()
        else:  # ids may come from the host (a no-op when they are on the device already)
            ids, error = self._check_ids(ids.to(self.device, non_blocking=True))
        handoff = self.handoff_dtype(ids.device)
        divisors = mean_divisors(ids, self.means, self.layout.offsets)
        prefetched = staged.prefetched if staged is not None else {}
        if self.sample_major is not None:
            [(key, group)] = self.groups.items()
            if self.column_maps:
                with timing.phase("dynamic_map"):
                    training = self.training and torch.is_grad_enabled()
                    ids = remap_columns(ids, self.column_maps, self.dynamic, group, training)
            with timing.phase("lookup"):
                made = staged.sample_major if staged is not None else None
                out_dtype = handoff or torch.float32
                pooled = lookup_sample_major(
                    ids, self.sample_major, group, out_dtype, made, prefetched.get(key)
                )
                return divide_means(pooled, divisors)
        routed = staged.routed if staged is not None else None
        if routed is None:
            with timing.phase("input_dist"):
                routed = self._input_dist(ids, error)
        row_stats = RowStats() if self.layout.exchange_row_stats else None
        if self.dynamic:
            with timing.phase("dynamic_map"):
                training = self.training and torch.is_grad_enabled()
                routed = remap(routed, self.dynamic, self.groups, training)
        with timing.phase("lookup"):
            pooled = lookup_groups(routed, self.groups, self.layout, row_stats, prefetched)
        with timing.phase("data_parallel"):
            replicated, dp_inputs = replicated_lookup(ids, self.layout, self.groups)
            if handoff is not None:
                replicated = replicated.to(handoff)
        wire = (
            handoff or self.comm_dtype,
            handoff is not None,
            1.0 / self.world if handoff is not None else 1.0,
        )
        after = self._after_backward(routed, dp_inputs, row_stats)
        with timing.phase("output_dist"):
            received, replicated = output_dist(
                pooled, replicated, routed, self.layout, self.group, self.stats, wire, after
            )
        out = reassemble(received, routed.kept, replicated, self.layout, divisors)
        if handoff is not None or self.world == 1:  # 1/W: in the exchange's backward, or 1
            return out
        return ScaleGrad.apply(out, 1.0 / self.world)

    def _after_backward(self, routed: Routed, dp_inputs: ReplicaInputs, row_stats: RowStats | None):  # noqa: ANN202 (a closure)
        """The output dist's backward work after its all-to-all, in this order on every rank:
        column shards share row statistics, then replicated tables sync and update."""

        def after(grad_send: torch.Tensor, grad_replicated: torch.Tensor) -> None:
            if row_stats is not None:
                share_row_stats(
                    grad_send, routed, self.layout, self.group, self.stats, row_stats, self.groups
                )
            if self.layout.dp_tables:
                sync_replicas(
                    grad_replicated, dp_inputs, self.layout, self.groups, self.group, self.stats
                )

        return after
