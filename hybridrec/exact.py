"""Exact mode: a training step whose every bit is the same at any world size (docs/exact.md).

    model = hybridrec.parallelize(MyModel(), batch_size=4096, sparse_optimizer=...,
                                  exact_shards=8)          # not DDP-wrapped
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = hybridrec.exact_step(model, bce, dense, ids, labels)   # this rank's slice
    opt.step()                                             # .grad holds the combined gradient

The global batch of B samples is cut into M micro-shards of m = B / M samples (M, `exact_shards`,
is fixed whatever the world size W; W must divide it), rank r holding micro-shards r * M/W ..
(r + 1) * M/W - 1, a contiguous run, as its B / W samples. One step:

1. each EmbeddingTables looks up the rank's whole batch once (one exchange, the dynamic maps'
   one step, the host caches' prefetch: as the default step), in exact mode
   (hybridrec.sparse.exact: the sums of the embedding side in a canonical order);
2. the model runs on each micro-shard on its own, its tables served their rows of that lookup
   (EmbeddingTables.lookup_through), its random stream seeded by (seed, step, micro-shard):
   every kernel sees the shapes it sees in one process, so each micro-shard's outputs and
   gradients are the same bits at any W;
3. the micro-shards' outputs (and `targets`) are gathered from every rank in global order and
   `loss_fn` runs on the whole global batch on every rank (no collective inside it): the loss
   and its gradient are one process's;
4. each micro-shard's backward, with its rows of that gradient, gives its partial dense
   gradient; the embeddings' gradient (each sample's rows, concatenated: nothing is summed)
   runs the exchange's backward, which updates the rows in canonical order;
5. the dense partial gradients are added by a fixed tree over the M micro-shards
   (hybridrec.distributed.exact_sum.exact_all_reduce) into every parameter's .grad (set, not
   accumulated); no DDP, no all-reduce. The dense optimizer then steps as usual.

The loss is a function of the whole global batch, so the gradient needs no 1/W: exact mode
scales nothing by the world size (the gradient-scaling rule of docs/architecture.md is the
default path's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hybridrec import timing
from hybridrec.distributed.comm import world_size
from hybridrec.distributed.exact_sum import exact_all_reduce, gathers_all, tree_sum_rows
from hybridrec.distributed.packed import all_gather_packed
from hybridrec.model.tables import EmbeddingTables
from hybridrec.shard import declarations
from hybridrec.sparse.exact import ExactCollection
from hybridrec.types import KeyedIds

IdsOf = Callable[[EmbeddingTables], torch.Tensor]


def micro_seed(seed: int, step: int, micro_shard: int) -> int:
    """The random seed of a micro-shard's forward at optimizer step `step` (the same at any
    world size: dropout draws the same masks)."""
    digest = hashlib.sha256(f"exact/{seed}/{step}/{micro_shard}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def exact_tables(model: nn.Module) -> list[tuple[EmbeddingTables, ExactCollection]]:
    """The model's declarations and their exact-mode storage (ValueError, one line, for a
    model not parallelized with exact_shards)."""
    found = [(t, t.storage) for t in declarations(model)]
    if not found or not all(isinstance(s, ExactCollection) for _, s in found):
        raise ValueError(
            f"{type(model).__name__} was not parallelized in exact mode: call "
            "hybridrec.parallelize(model, ..., exact_shards=M) first (docs/exact.md)"
        )
    return found  # type: ignore[return-value]


class _Replay:
    """A micro-shard's lookup of one declaration: the rows `expected` [m, H] get, once."""

    def __init__(self, name: str, expected: torch.Tensor, rows: torch.Tensor) -> None:
        self.name, self.expected, self.rows, self.used = name, expected, rows, False

    def __call__(self, cols: torch.Tensor) -> torch.Tensor:
        if self.used:
            raise ValueError(
                f"exact mode: EmbeddingTables {self.name} was looked up twice in one "
                "micro-shard's forward; exact mode looks up each declaration's ids of the "
                "whole batch once per step (pass ids_of= for ids the batch does not hold)"
            )
        if cols.shape != self.expected.shape or not torch.equal(cols, self.expected):
            raise ValueError(
                f"exact mode: EmbeddingTables {self.name} was asked for other ids than its "
                f"columns of this micro-shard ({list(cols.shape)} vs "
                f"{list(self.expected.shape)}); pass ids_of= giving each declaration's ids of "
                "the whole batch"
            )
        self.used = True
        return self.rows


class ExactForward:
    """A step's forward in exact mode (`exact_forward`): `outputs`, the model's outputs of the
    whole global batch (its output structure, every tensor [B, ...], the same on every rank),
    and `targets`, the targets gathered likewise [B, ...]. The caller computes the loss of
    them (no collective: every rank computes the same), then `backward(loss)` finishes the
    step: rows updated, dense .grad set."""

    def __init__(
        self,
        model: nn.Module,
        outputs: Any,
        targets: list[torch.Tensor],
        micro: list[list[Any]],
        gathered: list[torch.Tensor | None],
        lookups: list[tuple[torch.Tensor, list[torch.Tensor]]],
        position: tuple[int, int, int],
        group: Any,
        storages: list[ExactCollection],
    ) -> None:
        self.model, self.outputs, self.targets = model, outputs, targets
        self._storages = storages
        self._micro, self._gathered, self._lookups = micro, gathered, lookups
        self._position, self._group = position, group

    def backward(self, loss: torch.Tensor) -> None:
        """Micro-shard backwards, the embeddings' backward (rows updated in canonical order),
        the dense gradients added by the fixed tree into .grad (module docstring, 4-5).
        `loss`: a scalar computed from `outputs` and `targets` alone."""
        first, m_local, m = self._position
        leaves = [i for i, g in enumerate(self._gathered) if g is not None]
        grads = torch.autograd.grad(loss, [self._gathered[i] for i in leaves], allow_unused=True)
        params = [p for p in self.model.parameters() if p.requires_grad]
        sizes = [p.numel() for p in params]
        parts = torch.empty(m_local, sum(sizes))
        row_grads: list[list[torch.Tensor]] = [[] for _ in self._lookups]
        for j, outs in enumerate(self._micro):
            at = (first + j) * m
            tensors, seeds = [], []
            for i, g in zip(leaves, grads, strict=True):
                if g is not None and outs[i].requires_grad:
                    tensors.append(outs[i])
                    seeds.append(g[at : at + m])
            rows = [r[j] for _, r in self._lookups]
            # the partial gradients by value (autograd.grad: the bits .grad would accumulate
            # from None), straight into this micro-shard's row of `parts`
            got = (torch.autograd.grad(tensors, params + rows, seeds, allow_unused=True)
                   if tensors else (None,) * (len(params) + len(rows)))  # fmt: skip
            if params:
                flat = [g.reshape(-1) if g is not None else p.new_zeros(n)
                        for g, p, n in zip(got, params, sizes, strict=False)]  # fmt: skip
                torch.cat(flat, out=parts[j])
            for k, (g, r) in enumerate(zip(got[len(params) :], rows, strict=True)):
                row_grads[k].append(g if g is not None else torch.zeros_like(r))
        for (pooled, _), grad in zip(self._lookups, row_grads, strict=True):
            torch.autograd.backward(pooled, torch.cat(grad))
        # the replicated tables' inputs (hybridrec.sparse.exact.replicas) travel with the
        # dense partials when those take exact_all_reduce's one-all-gather way: one collective
        pending = [s.all_to_all.take_replica_inputs() for s in self._storages]
        extra = [t for p in pending for t in p]
        world, group = world_size(self._group), self._group
        with timing.phase("dense_grads"):
            if params and gathers_all(world, m_local, parts.shape[1]):
                gathered = all_gather_packed([parts, *extra], group, name="dense_grads (exact)")
                total, rest = tree_sum_rows(gathered[0]), gathered[1:]
            else:
                rest = all_gather_packed(extra, group, name="dp_grads (exact)")
                total = (
                    exact_all_reduce(parts, group, name="dense_grads (exact)") if params else None
                )
        at = 0
        for storage, inputs in zip(self._storages, pending, strict=True):
            storage.all_to_all.finish_replicas(rest[at : at + len(inputs)])
            at += len(inputs)
        if total is not None:
            for p, g in zip(params, total.split(sizes), strict=True):
                p.grad = g.view_as(p)


def _leaves(out: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """A model output's leaves and how to rebuild it from new ones: tensors, None and other
    values of any nesting of tuples, lists and dicts (torch's pytree), or of a dataclass's
    fields (hybridrec.model.sequential.NextItemOutputs)."""
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        names = [f.name for f in dataclasses.fields(out)]
        flat, spec = pytree.tree_flatten(tuple(getattr(out, n) for n in names))

        def rebuild(leaves: list[Any]) -> Any:
            values = pytree.tree_unflatten(leaves, spec)
            return dataclasses.replace(out, **dict(zip(names, values, strict=True)))

        return flat, rebuild
    flat, spec = pytree.tree_flatten(out)
    return flat, lambda leaves: pytree.tree_unflatten(leaves, spec)


def _slice_ids(ids: KeyedIds | torch.Tensor, sl: slice) -> KeyedIds | torch.Tensor:
    if isinstance(ids, KeyedIds):
        return KeyedIds(ids.values[sl].clone(), ids.names, ids.hotness)
    return ids[sl].clone()


def _columns(tables: EmbeddingTables, ids: KeyedIds | torch.Tensor) -> torch.Tensor:
    return tables.select(ids) if isinstance(ids, KeyedIds) else ids


@contextlib.contextmanager
def _micro_shard(
    found: Sequence[tuple[EmbeddingTables, ExactCollection]],
    replays: Sequence[_Replay],
    seed: int,
) -> Iterator[None]:
    """One micro-shard's forward: each declaration served its replay, the CPU generator
    seeded (the caller forks the random state once for all micro-shards: exact mode is CPU
    only, and torch.manual_seed's lazy seeding of the other devices costs ms per call)."""
    with contextlib.ExitStack() as stack:
        for (tables, _), replay in zip(found, replays, strict=True):
            stack.enter_context(tables.lookup_through(replay))
        torch.default_generator.manual_seed(seed)
        yield


def exact_forward(
    model: nn.Module,
    dense: torch.Tensor,
    ids: KeyedIds | torch.Tensor,
    *targets: torch.Tensor,
    ids_of: IdsOf | None = None,
    **kwargs: Any,
) -> ExactForward:
    """Steps 1-3 of an exact step (module docstring) on this rank's slice of the global batch:
    dense [B_l, F], ids [B_l, H] (KeyedIds, or a tensor for a model of one declaration),
    `targets` per-sample tensors [B_l, ...], gathered into the ExactForward. `ids_of(tables)`:
    a declaration's ids of the whole local batch when they are not its columns of `ids`;
    `kwargs` go to every micro-shard's forward. Collective."""
    found = exact_tables(model)
    storage = found[0][1]
    world, rank, group = storage.world, storage.rank, storage.group
    m_local = storage.micro_shards // world
    b_local = dense.shape[0]
    if b_local % m_local:
        raise ValueError(
            f"exact mode: this rank's {b_local} samples do not split into its {m_local} "
            f"micro-shards; the global batch must be divisible by exact_shards="
            f"{storage.micro_shards}"
        )
    m = b_local // m_local
    step = storage.sparse_step
    lookups, replays = [], []
    for tables, s in found:  # 1. the whole batch's lookups, once
        cols = ids_of(tables) if ids_of is not None else _columns(tables, ids)
        s.in_step = True
        try:
            pooled = s(cols)
        finally:
            s.in_step = False
        rows = [pooled.detach()[j * m : (j + 1) * m].clone().requires_grad_()
                for j in range(m_local)]  # fmt: skip
        lookups.append((pooled, rows))
        replays.append((tables, cols, rows))
    outputs: list[list[Any]] = []
    with torch.random.fork_rng(devices=[]):  # 2. the model per micro-shard
        for j in range(m_local):
            sl = slice(j * m, (j + 1) * m)
            mine = [_Replay(type(t).__name__, c[sl], rows[j]) for t, c, rows in replays]
            with _micro_shard(found, mine, micro_seed(storage.seed, step, rank * m_local + j)):
                out = model(dense[sl].clone(), _slice_ids(ids, sl), **kwargs)
            flat, rebuild = _leaves(out)
            kinds = [isinstance(x, torch.Tensor) for x in flat]
            if outputs and kinds != [isinstance(x, torch.Tensor) for x in outputs[0]]:
                raise ValueError(
                    "exact mode: the model's outputs differ in structure by micro-shard"
                )
            outputs.append(flat)
    local = []  # 3. the global batch's outputs and targets, everywhere: one all-gather
    for i, leaf in enumerate(outputs[0]):
        if not isinstance(leaf, torch.Tensor):
            continue
        bad = [tuple(o[i].shape) for o in outputs if o[i].dim() == 0 or o[i].shape[0] != m]
        if bad:
            raise ValueError(
                f"exact mode: every tensor the model returns must hold its micro-shard's {m} "
                f"samples along dim 0 (the loss runs on them gathered), got {list(bad[0])}"
            )
        local.append(torch.cat([o[i].detach() for o in outputs]))
    whole = iter(all_gather_packed([*local, *targets], group, name="exact_gather"))
    gathered: list[torch.Tensor | None] = []
    values = []
    for leaf in outputs[0]:
        if not isinstance(leaf, torch.Tensor):
            gathered.append(None)
            values.append(leaf)
            continue
        value = next(whole)
        if leaf.requires_grad:
            value = value.detach().requires_grad_()  # a leaf of its own: the loss's input
        gathered.append(value if leaf.requires_grad else None)
        values.append(value)
    return ExactForward(
        model, rebuild(values), list(whole), outputs, gathered, lookups,
        (rank * m_local, m_local, m), group, [s for _, s in found],
    )  # fmt: skip


def exact_step(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    dense: torch.Tensor,
    ids: KeyedIds | torch.Tensor,
    *targets: torch.Tensor,
    ids_of: IdsOf | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """One exact step on this rank's slice: exact_forward, the loss `loss_fn(outputs,
    *targets)` of the whole global batch (a function of them alone: no collective), then the
    backward. The embedding rows are updated and every dense parameter's .grad holds the global
    batch's gradient; returns the loss (detached; the same on every rank). Step the dense
    optimizer after it. Collective: every rank calls it with its slice of one global batch."""
    forward = exact_forward(model, dense, ids, *targets, ids_of=ids_of, **kwargs)
    loss = loss_fn(forward.outputs, *forward.targets)
    forward.backward(loss)
    return loss.detach()
