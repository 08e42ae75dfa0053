"""Cost model of a sharding plan: bytes stored and exchanged per rank, and a time estimate.

`estimate_cost` follows the exchange protocol of `hybridrec.sparse` exactly, with the
runtime's own byte sizes (`hybridrec.sparse.costs`); a distributed test compares its bytes
to what the all-to-alls really send. Per rank and forward step: ids into the input dist
(row-wise shards: their expected share, ids assumed uniform over the rows), rows gathered by
the lookup, pooled embeddings out of the output dist (row-wise shards: only the bags with
an id in the shard, 1 - (1 - share)^ids of them; a sequence feature: a row per id, its
expected ids, a row-wise shard's share of them); backward mirrors it, plus the
replicated tables' gradient sync (`replica_sync`, the runtime's choice). A rank never counts
what it sends to itself. Times are lower bounds from bandwidths alone (no latency, no
overlap): max(sent, received) / bw per exchange (the slower of the same-node and other-node
parts), bytes / hbm_bw for lookups and updates. Memory is the memory model's
(`rank_memory`), so the plan table and the planner's budget check agree. The full model,
term by term, is in docs/planner.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridrec.planner.memory import rank_memory
from hybridrec.planner.types import NO_OPTIMIZER_STATE, OptimizerFootprint, Topology, human_bytes
from hybridrec.sparse.costs import EMB_BYTES, ID_BYTES, counted, id_wire_bytes, replica_sync
from hybridrec.types import ModeTraits, ShardingPlan, ShardSpec, TableConfig, storage_tables


@dataclass(frozen=True)
class RankCost:
    """What one rank stores (bytes), exchanges per forward step (bytes) and spends (seconds).

    Exchange bytes exclude what the rank sends to itself; row-wise traffic is an expectation,
    hence floats.
    """

    rank: int
    num_shards: int
    weight_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    total_bytes: int
    ids_sent_bytes: float
    ids_recv_bytes: float
    emb_sent_bytes: float
    emb_recv_bytes: float
    dp_grad_sent_bytes: float
    dp_grad_recv_bytes: float
    lookups_per_step: float  # rows gathered by this rank's lookups per step (forward)
    input_dist_s: float
    lookup_s: float
    output_dist_s: float
    backward_s: float  # embedding-gradient exchange + DP gradient all-gather + row updates
    total_s: float  # the sum of the four phases (no overlap assumed)


@dataclass(frozen=True)
class PlanCost:
    """Per-rank costs of a plan, with the totals a reader wants first."""

    world_size: int
    budget_bytes: int
    table_bytes: int  # weights of all tables, each counted once (replicas not multiplied)
    ranks: tuple[RankCost, ...]

    @property
    def peak_bytes(self) -> int:
        return max((r.total_bytes for r in self.ranks), default=0)

    @property
    def total_bytes(self) -> int:
        """Memory over all ranks (replicated tables counted on every rank)."""
        return sum(r.total_bytes for r in self.ranks)

    @property
    def step_s(self) -> float:
        """Estimated embedding time per step: the slowest rank (ranks meet at every all-to-all)."""
        return max((r.total_s for r in self.ranks), default=0.0)

    def summary(self) -> str:
        """One line: '420.9 GiB of tables over 8 ranks, peak rank 55.0 GiB of 75.0 GiB budget,
        est. step 2.05 ms' (the step estimate covers the embedding part only)."""
        return (
            f"{human_bytes(self.table_bytes)} of tables over {self.world_size} "
            f"rank{'s' if self.world_size != 1 else ''}, "
            f"peak rank {human_bytes(self.peak_bytes)} of {human_bytes(self.budget_bytes)} "
            f"budget, est. step {self.step_s * 1e3:.3g} ms"
        )


class _Exchange:
    """An all-to-all where p sends q `to[q] + frm[p]` bytes for every p != q.

    `to[q]`: what every other rank sends to q (ids for q's shards); `frm[p]`: what p sends to
    every other rank (its pooled outputs, all-gathered ids). Sums by node keep this O(W).
    """

    def __init__(self, world: int) -> None:
        self.to: list[float] = [0] * world
        self.frm: list[float] = [0] * world

    def per_rank(self, topo: Topology) -> list[tuple[float, float, float, float]]:
        """(sent same-node, sent other-node, received same-node, received other-node) per rank."""
        world = len(self.to)
        nodes = [topo.node_of(r) for r in range(world)]
        to_node: dict[int, float] = {}
        frm_node: dict[int, float] = {}
        size: dict[int, int] = {}
        for r, n in enumerate(nodes):
            to_node[n] = to_node.get(n, 0) + self.to[r]
            frm_node[n] = frm_node.get(n, 0) + self.frm[r]
            size[n] = size.get(n, 0) + 1
        all_to, all_frm = sum(self.to), sum(self.frm)
        out = []
        for r, n in enumerate(nodes):
            sent = all_to - self.to[r] + (world - 1) * self.frm[r]
            sent_near = to_node[n] - self.to[r] + (size[n] - 1) * self.frm[r]
            recv = (world - 1) * self.to[r] + all_frm - self.frm[r]
            recv_near = (size[n] - 1) * self.to[r] + frm_node[n] - self.frm[r]
            out.append((sent_near, sent - sent_near, recv_near, recv - recv_near))
        return out


def _comm_s(
    near_sent: float, far_sent: float, near_recv: float, far_recv: float, topo: Topology
) -> float:
    return max(
        max(near_sent, near_recv) / topo.intra_node_bw, max(far_sent, far_recv) / topo.inter_node_bw
    )


def _unit_traffic(
    traits: ModeTraits,
    t: TableConfig,
    s: ShardSpec,
    b_local: int,
    id_bytes: int,
    comm_bytes: int,
    ids: _Exchange,
    emb: _Exchange,
) -> float:
    """Add feature t's exchange bytes in shard s (of a table whose mode has `traits`) to
    `ids` and `emb`; returns the rows its lookup gathers per local batch (the unit, sharded,
    serves W of them)."""
    if traits.replicated:  # looked up locally: nothing crosses the exchanges
        return float(b_local * t.hotness)
    if traits.partial_sums:
        share = s.num_rows / t.num_rows
        ids.to[s.rank] += b_local * id_bytes + b_local * t.expected_ids * share * id_bytes
        # compact partial sums: only the bags with an id in the shard come back (a
        # sequence's: a row per id in the shard)
        back = t.expected_ids * share if t.sequence else 1.0 - (1.0 - share) ** t.expected_ids
        emb.frm[s.rank] += b_local * back * s.width * comm_bytes
        return b_local * t.expected_ids * share
    counts = b_local * id_bytes if t.jagged else 0  # a jagged feature's ids: with a count each
    ids.to[s.rank] += counts + b_local * t.expected_ids * id_bytes
    back = t.expected_ids if t.sequence else 1.0  # a sequence: a row per id comes back
    emb.frm[s.rank] += b_local * back * s.width * comm_bytes
    return float(b_local * t.expected_ids)


def estimate_cost(
    plan: ShardingPlan,
    tables: Sequence[TableConfig],
    topology: Topology,
    batch_size: int,
    optimizer: OptimizerFootprint = NO_OPTIMIZER_STATE,
    weight_bytes: int = 4,
    comm_bytes: int = EMB_BYTES,
) -> PlanCost:
    """Bytes and estimated seconds per rank for one training step of `plan` (docs/planner.md).
    `comm_bytes`: bytes per pooled value (and gradient) in the output dist (sharding.comm_dtype)."""
    world = plan.world_size
    if topology.world_size != world:
        raise ValueError(f"plan is for {world} ranks, topology for {topology.world_size}")
    if batch_size < 1 or batch_size % world != 0:
        raise ValueError(
            f"batch_size must be a positive multiple of world_size {world}, got {batch_size}"
        )
    by_name = {t.name: t for t in storage_tables(tables)}
    users: dict[str, list[TableConfig]] = {}  # table -> the features looking it up
    for f in tables:
        users.setdefault(f.table_name, []).append(f)
    missing = [tp.table for tp in plan.tables if tp.table not in by_name]
    if missing:
        raise ValueError(f"plan tables missing from `tables`: {missing}")
    b_local = batch_size // world
    id_bytes = id_wire_bytes(tables)

    ids, emb = _Exchange(world), _Exchange(world)
    dp_reduce = [0.0] * world  # bytes sent to sync replicated tables' gradients
    dp_groups: dict[tuple[int, int], list[int]] = {}  # (rank, width) -> [rows, ids per step]
    lookups = [0.0] * world  # rows gathered per step
    fwd_bytes = [0.0] * world  # bytes read by the forward gather
    upd_bytes = [0.0] * world  # bytes touched by the backward update
    shards = [0] * world
    for tp in plan.tables:
        traits = tp.sharding.traits
        for s in tp.shards:
            shards[s.rank] += 1
            rows = 0.0
            for t in users[tp.table]:  # each feature's lookup in this shard (a unit)
                rows += _unit_traffic(traits, t, s, b_local, id_bytes, comm_bytes, ids, emb)
            if traits.replicated:
                group = dp_groups.setdefault((s.rank, s.width), [0, 0])
                group[0] += s.num_rows
                group[1] += int(rows)
            else:
                rows *= world  # the unit serves the global batch
            lookups[s.rank] += rows
            fwd_bytes[s.rank] += rows * s.width * weight_bytes
            state = optimizer.bytes_per_row + s.width * optimizer.bytes_per_element
            upd_bytes[s.rank] += rows * (
                s.width * EMB_BYTES + 2 * s.width * weight_bytes + 2 * state
            )
    for (rank, width), (rows, ids_per_rank) in dp_groups.items():
        # replicated tables of one width form one fused group, synced together
        dp_reduce[rank] += replica_sync(rows, width, ids_per_rank, world)[1]
    for r in range(world):  # every chunk of the input dist starts with its bad-id flag
        ids.frm[r] += id_bytes
    if any(counted(tp.sharding.traits, by_name[tp.table].jagged) for tp in plan.tables):
        for r in range(world):  # the payload sizes' exchange: one int64 to every other rank
            ids.frm[r] += ID_BYTES

    memory = rank_memory(plan, tables, batch_size, optimizer, weight_bytes)
    ids_t, emb_t = ids.per_rank(topology), emb.per_rank(topology)
    multi_node = topology.node_of(world - 1) != topology.node_of(0)
    reduce_bw = topology.inter_node_bw if multi_node else topology.intra_node_bw
    ranks = []
    for r in range(world):
        input_s = _comm_s(*ids_t[r], topology)
        lookup_s = fwd_bytes[r] / topology.hbm_bw
        output_s = _comm_s(*emb_t[r], topology)
        # the gradient exchange mirrors the output dist: sent and received swap, same time
        dp_s = dp_reduce[r] / reduce_bw
        backward_s = output_s + dp_s + upd_bytes[r] / topology.hbm_bw
        ranks.append(
            RankCost(
                rank=r,
                num_shards=shards[r],
                weight_bytes=memory[r].weights,
                optimizer_bytes=memory[r].optimizer,
                buffer_bytes=memory[r].buffers,
                total_bytes=memory[r].total,
                ids_sent_bytes=ids_t[r][0] + ids_t[r][1],
                ids_recv_bytes=ids_t[r][2] + ids_t[r][3],
                emb_sent_bytes=emb_t[r][0] + emb_t[r][1],
                emb_recv_bytes=emb_t[r][2] + emb_t[r][3],
                dp_grad_sent_bytes=dp_reduce[r],
                dp_grad_recv_bytes=dp_reduce[r],
                lookups_per_step=lookups[r],
                input_dist_s=input_s,
                lookup_s=lookup_s,
                output_dist_s=output_s,
                backward_s=backward_s,
                total_s=input_s + lookup_s + output_s + backward_s,
            )
        )
    table_bytes = sum(
        by_name[tp.table].num_rows * by_name[tp.table].dim * weight_bytes for tp in plan.tables
    )
    return PlanCost(world, topology.hbm_bytes_per_rank, table_bytes, tuple(ranks))
