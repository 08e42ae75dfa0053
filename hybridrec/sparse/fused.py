"""A fused embedding group: every same-width table or shard of one rank in one weight.

Layout (like NVIDIA DLRM's JointEmbedding): the group's U shards are stacked row-wise in
`weight` [R, D]; shard u owns rows row_offsets[u]:row_offsets[u+1]. One lookup call serves
every shard of the group: ids are shifted by their shard's offset, gathered in one
index_select and pooled into bags in one index_add_ (a segment sum).

Backward applies the optimizer in place, inside autograd's backward pass: the gradient of
each gathered row is its bag's gradient (times the pooling scale); rows are deduplicated
(hybridrec.kernels.segment: a sort and a segment sum, or on the CPU one hashing pass in C)
and the row optimizer updates just those rows and their state.
No sparse-gradient tensor and no dense gradient of a table is ever built. Autograd reaches
this backward through a zero-size "anchor" tensor that requires grad, since the weight
itself is a buffer (it must not be seen by DDP or by the dense optimizer).

Legend: N = ids in the call, R = rows in the group, D = group width, U = shards in the group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from hybridrec import timing
from hybridrec.kernels.dispatch import available
from hybridrec.kernels.lookup import pool
from hybridrec.kernels.pages import huge_pages
from hybridrec.kernels.rows import seen_grads
from hybridrec.kernels.segment import (
    Segments,
    dedupe,
    dedupe_any_order,
    scale_tensor,
    segment_grads_padded,
)
from hybridrec.sparse.init import init_shard
from hybridrec.types import ShardSpec, StateKind, TableConfig


class RowOptimizer(Protocol):
    """What a group needs from a sparse optimizer (implemented in hybridrec.optim.sparse).

    `needs_full_row_stat`: its maths reads each row's mean of g^2 over the row's full width,
    so a table split column-wise shares it across its column shards (`row_sq_mean`).
    `weight_decay_mode` and `weight_decay_for(table)`: each table's decay (see
    hybridrec.kernels.decay); a group holding tables of different decays passes one per row.
    """

    name: str
    needs_full_row_stat: bool
    weight_decay_mode: str

    def state_spec(self) -> dict[str, StateKind]:
        """Optimizer state: name -> its kind, one fp32 per row ([R]) or per element ([R, D])."""
        ...

    def weight_decay_for(self, table: str) -> float:
        """The weight decay of storage table `table` (its qualified name)."""
        ...

    def update(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grads: torch.Tensor,
        step: int,
        row_sq_mean: torch.Tensor | None = None,
        count: torch.Tensor | None = None,
        weight_decay: float | torch.Tensor | None = None,
    ) -> None:
        """Update weight[rows] (rows [U], unique) with grads [U, D] at optimizer step >= 1.

        `row_sq_mean` [U], when given, is mean(g^2) over each row's full width (a column
        shard only sees part of the row; with L2 decay, of g + wd * w); optimizers with
        row-wise state use it. `count` ([1] int64 on the device), when given, says only the
        first count rows are real (the rest is padding from Triton's sync-free dedupe).
        `weight_decay`: the rows' decay, one float or [U] fp32 per row (None: its own).
        """
        ...


@dataclass(frozen=True)
class LookupInput:
    """Ids for one shard of a group.

    ids  [N_u] int64 row ids relative to the shard (0 <= id < shard rows)
    bags [N_u] int64 bag (output row) of each id, 0 <= bag < num_bags, non-decreasing
    scale      pooling multiplier for every id: 1 for sum, 1/hotness for mean
    """

    ids: torch.Tensor
    bags: torch.Tensor
    num_bags: int
    scale: float = 1.0


RowSq = dict[int, torch.Tensor]  # shard index in the group -> full-row mean(g^2) [U_u]
RowSqSource = Callable[[], "RowSq | None"]  # asked once, in the backward


class _GroupLookup(torch.autograd.Function):
    """pooled[bag] = sum_i scale_i * weight[row_i]; backward = in-place optimizer update."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        anchor: torch.Tensor,
        group: FusedEmbedding,
        rows: torch.Tensor,
        bags: torch.Tensor,
        scale: torch.Tensor | None,
        num_bags: int,
        out_dtype: torch.dtype,
        row_sq: RowSqSource | None,
        prefetched: Any,
    ) -> torch.Tensor:
        ctx.group, ctx.row_sq = group, row_sq
        ctx.save_for_backward(rows, bags, scale)
        pooled, ctx.segments = group.pool(rows, bags, scale, num_bags, out_dtype, prefetched, True)
        return pooled

    @staticmethod
    def backward(ctx: Any, grad_pooled: torch.Tensor) -> tuple:  # type: ignore[override]
        rows, bags, scale = ctx.saved_tensors
        row_sq = ctx.row_sq() if ctx.row_sq is not None else None
        ctx.group.apply_gradient(rows, bags, scale, grad_pooled, row_sq, ctx.segments)
        return (torch.zeros(0, device=grad_pooled.device), *(None,) * 8)


class FusedEmbedding(nn.Module):
    """U same-width shards in one weight [R, D], with their optimizer state.

    `shards` pairs each ShardSpec with its table's config and the table's index in the model
    (the index seeds the initial values, so every sharding starts from identical weights).
    `input_slots`: per lookup input, the shard it reads (default: input u reads shard u);
    features sharing a table give several inputs one shard.
    """

    def __init__(
        self,
        shards: Sequence[tuple[TableConfig, int, ShardSpec]],
        optimizer: RowOptimizer | None,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        input_slots: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if not shards:
            raise ValueError("a fused embedding group needs at least one shard")
        widths = {s.width for _, _, s in shards}
        if len(widths) != 1:
            raise ValueError(f"all shards of a fused group must share one width, got {widths}")
        self.width = widths.pop()
        self.shards = [s for _, _, s in shards]
        self.input_slots = list(range(len(shards)) if input_slots is None else input_slots)
        self.optimizer = optimizer
        self.step_count = 0
        offsets = [0]
        for s in self.shards:
            offsets.append(offsets[-1] + s.num_rows)
        self.offsets_list = offsets
        self.register_buffer("row_offsets", torch.tensor(offsets, dtype=torch.int64, device=device))
        # each shard's weight decay, where they differ (row_decay): made here, not in a step
        self._slot_decays = self._decays()
        slot_decay = torch.tensor(self._slot_decays or [0.0] * len(self.shards), device=device)
        self.register_buffer("slot_decay", slot_decay, persistent=False)
        self.state_names: list[str] = []
        self.state_shapes: dict[str, tuple[int, ...]] = {}
        if optimizer is not None:
            for name, kind in optimizer.state_spec().items():
                self.state_shapes[name] = StateKind(kind).shape(offsets[-1], self.width)
                self.state_names.append(name)
        self._init_storage(shards, seed, torch.device(device), dtype)

    def _init_storage(
        self,
        shards: Sequence[tuple[TableConfig, int, ShardSpec]],
        seed: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """The rows and their optimizer state, as device buffers (see HostCachedEmbedding for
        host-resident storage)."""
        weight = torch.empty(self.num_rows, self.width, dtype=dtype)  # one host copy, not two
        if device.type == "cpu":  # rows read at random: huge pages spare TLB misses
            huge_pages(weight)
        for (t, i, s), a, b in zip(shards, self.offsets_list, self.offsets_list[1:], strict=False):
            init_shard(t, i, s, seed, dtype, out=weight[a:b])
        self.register_buffer("weight", weight.to(device))
        for name, shape in self.state_shapes.items():
            state = torch.empty(shape, device=device)
            huge_pages(state)  # (a no-op off the CPU)
            self.register_buffer(f"state_{name}", state.zero_())

    @property
    def num_rows(self) -> int:
        return self.offsets_list[-1]

    def state(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, f"state_{n}") for n in self.state_names}

    def shard_views(self) -> list[tuple[ShardSpec, torch.Tensor, dict[str, torch.Tensor]]]:
        """Per shard: its spec, a view [rows_u, D] of its rows, and views of its state rows."""
        out = []
        for u, spec in enumerate(self.shards):
            a, b = self.offsets_list[u], self.offsets_list[u + 1]
            out.append((spec, self.weight[a:b], {n: s[a:b] for n, s in self.state().items()}))
        return out

    @torch.no_grad()
    def reset_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Rows `rows` [K] (group rows, distinct) start over: weight[rows] = values [K, D],
        their optimizer state zero (a dynamic table's slot given to a new id)."""
        self.weight.index_copy_(0, rows, values.to(self.weight.dtype))
        for state in self.state().values():
            state.index_fill_(0, rows, 0.0)

    def flatten(
        self, inputs: Sequence[LookupInput]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
        """Group-level (rows [N], bags [N], per-id scale [N] or None, bags per shard)."""
        assert len(inputs) == len(self.input_slots), "one LookupInput per input slot"
        rows, bags, scales, sizes = [], [], [], []
        bag_base = 0
        any_scale = any(inp.scale != 1.0 for inp in inputs)
        for u, inp in zip(self.input_slots, inputs, strict=True):
            rows.append(inp.ids + self.offsets_list[u])
            bags.append(inp.bags + bag_base)
            if any_scale:
                scales.append(torch.full_like(inp.ids, inp.scale, dtype=torch.float32))
            sizes.append(inp.num_bags)
            bag_base += inp.num_bags
        scale_t = torch.cat(scales) if any_scale else None
        return torch.cat(rows), torch.cat(bags), scale_t, sizes

    def forward(
        self, inputs: Sequence[LookupInput], row_sq: RowSqSource | None = None
    ) -> list[torch.Tensor]:
        """One pooled tensor [num_bags_u, D] per input, in order (one gather for all).
        `row_sq`: asked in the backward for full-row statistics of column shards, if any."""
        rows_t, bags_t, scale_t, sizes = self.flatten(inputs)
        pooled = self.lookup(rows_t, bags_t, scale_t, sum(sizes), row_sq=row_sq)
        return list(torch.split(pooled, sizes))

    def lookup(
        self,
        rows: torch.Tensor,
        bags: torch.Tensor,
        scale: torch.Tensor | None,
        num_bags: int,
        out_dtype: torch.dtype = torch.float32,
        row_sq: RowSqSource | None = None,
        prefetched: Any = None,
    ) -> torch.Tensor:
        """pooled [num_bags, D] (out_dtype, summed in fp32) of group rows `rows` [N] (bags [N]
        non-decreasing, in any bag order the caller likes); training applies the optimizer
        in the backward, which takes the gradient in out_dtype and sums it in fp32.
        `prefetched`: what this group's prefetch() returned for these rows (host caches)."""
        if torch.is_grad_enabled() and self.optimizer is not None:
            anchor = torch.zeros(0, device=self.row_offsets.device, requires_grad=True)
            return _GroupLookup.apply(
                anchor, self, rows, bags, scale, num_bags, out_dtype, row_sq, prefetched
            )
        return self.pool(rows, bags, scale, num_bags, out_dtype, prefetched)[0]

    def pool(
        self,
        rows: torch.Tensor,
        bags: torch.Tensor,
        scale: torch.Tensor | None,
        num_bags: int,
        out_dtype: torch.dtype = torch.float32,
        prefetched: Any = None,
        training: bool = False,
    ) -> tuple[torch.Tensor, Segments | None]:
        """(pooled [num_bags, D] of group rows `rows` [N] (hybridrec.kernels.lookup.pool),
        segment.sorted_segments(rows) when the lookup made it (a host cache's admission sorts
        the rows: the backward's dedupe then takes it), else None). `training`: the backward
        will update these rows. A device group has no prefetch."""
        if prefetched is not None:
            raise TypeError("a device-resident group has no prefetch to take")
        return pool(self.weight, rows, bags, scale, num_bags, out_dtype), None

    def _update_target(
        self, unique_rows: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Where the optimizer writes: (weight, state, indices of `unique_rows` in them)."""
        return self.weight, self.state(), unique_rows

    @torch.no_grad()
    def apply_gradient(
        self,
        rows: torch.Tensor,
        bags: torch.Tensor,
        scale: torch.Tensor | None,
        grad_pooled: torch.Tensor,
        row_sq: RowSq | None = None,
        segments: Segments | None = None,
    ) -> None:
        """Deduplicate the rows' gradients and let the optimizer update them in place;
        `row_sq`: full-row statistics for some shards (see `update_rows`); `segments`: the
        sort of `rows` the lookup made, if it did (see `pool`)."""
        with timing.phase("sparse_update"):
            if not row_sq and available(grad_pooled):
                # Triton: dedupe into buffers padded to N, the distinct-row count stays on the
                # device, and the update kernels read it: no host sync in the step
                rows_pad, grads_pad, count = segment_grads_padded(
                    grad_pooled,
                    rows,
                    bags,
                    scale_tensor(scale, rows),
                    segments=segments,
                )
                self.update_rows(rows_pad, grads_pad, count)
                return
            # full-row statistics are matched to shards by searchsorted: sorted rows then
            dedupe_rows = dedupe if row_sq else dedupe_any_order
            unique_rows, grads = dedupe_rows(rows, bags, scale, grad_pooled)
            self.update_rows(unique_rows, grads, row_sq=row_sq)

    @torch.no_grad()
    def update_rows(
        self,
        unique_rows: torch.Tensor,
        grads: torch.Tensor,
        count: torch.Tensor | None = None,
        row_sq: RowSq | None = None,
    ) -> None:
        """One optimizer step on rows `unique_rows` [U] (distinct; sorted if `row_sq` is given)
        with gradients [U, D]; with
        `count` (a device tensor), only the first count rows are real (padded inputs).
        `row_sq`: for some shards, mean(g^2) over each row's full width (column shards of
        one table share it, see hybridrec.sparse.exchange.row_stats); other rows use their own."""
        assert self.optimizer is not None
        self.step_count += 1
        decay = self.row_decay(unique_rows)
        weight, state, index = self._update_target(unique_rows)
        row_sq_mean = None
        if row_sq:
            seen = seen_grads(self.optimizer, weight, index, grads, decay)
            row_sq_mean = seen.pow(2).mean(dim=1)
            bounds = torch.searchsorted(unique_rows, self.row_offsets).tolist()
            for u, stat in row_sq.items():
                row_sq_mean[bounds[u] : bounds[u + 1]] = stat
        self.optimizer.update(
            weight, state, index, grads, self.step_count, row_sq_mean, count=count,
            weight_decay=decay,
        )  # fmt: skip

    def seen_grads(self, unique_rows: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        """The gradient [U, D] fp32 the optimizer's maths see for rows `unique_rows` [U] with
        gradients `grads` [U, D] (with L2 decay, grads + wd * w), read before their update:
        what a full-row statistic is of (exact mode's, hybridrec.sparse.exact)."""
        assert self.optimizer is not None
        decay = self.row_decay(unique_rows)
        weight, _, index = self._update_target(unique_rows)
        return seen_grads(self.optimizer, weight, index, grads, decay)

    def row_decay(self, rows: torch.Tensor) -> float | torch.Tensor:
        """The weight decay of group rows `rows` [U]: one float when every shard here has the
        same (one table, or tables of one decay), else [U] fp32, each row its shard's table's
        (one searchsorted and one gather on the device; no host sync). Padding past a padded
        input's count maps to some shard: the kernels never read it."""
        decays = self._decays()
        if len(set(decays)) == 1:
            return decays[0]
        if decays != self._slot_decays:  # the optimizer's decays were changed since
            self.slot_decay.copy_(torch.tensor(decays))
            self._slot_decays = decays
        slot = torch.searchsorted(self.row_offsets[1:], rows, right=True)
        return self.slot_decay.index_select(0, slot.clamp_(max=len(decays) - 1))

    def _decays(self) -> tuple[float, ...]:
        """Each shard's weight decay (its table's), () without an optimizer."""
        if self.optimizer is None:
            return ()
        return tuple(self.optimizer.weight_decay_for(s.table) for s in self.shards)

    def get_extra_state(self) -> dict:
        return {"step_count": self.step_count}

    def set_extra_state(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
