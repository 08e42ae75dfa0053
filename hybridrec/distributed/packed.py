"""Several all-gathers in one collective: tensors of any dtypes packed as the bytes of a row.

On CPU/gloo a collective's fixed cost (its handshake, its wait for the slowest rank, its
threads' work) outweighs the bytes of the small per-sample tensors exact mode gathers
(hybridrec.exact: a step's outputs and targets; hybridrec.sparse.exact.replicas: the
replicated tables' ids and gradients), so they travel together. Moving bytes changes no bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybridrec.distributed.comm import CommStats, all_gather_rows, world_size


def all_gather_packed(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    name: str = "all_gather",
) -> list[torch.Tensor]:
    """Tensors [n, ...] (one n, any dtypes, bool included; the same shapes on every rank) ->
    each one's [W * n, ...], rank p's rows at block p, as `all_gather_rows` gives, by one
    all-gather of their bytes (each tensor itself on a one-rank group)."""
    if world_size(group) == 1 or not tensors:
        return list(tensors)
    n = tensors[0].shape[0]
    if any(t.dim() == 0 or t.shape[0] != n for t in tensors):
        shapes = [list(t.shape) for t in tensors]
        raise ValueError(f"all_gather_packed needs one row count along dim 0, got {shapes}")
    rows = [t.detach().reshape(n, math.prod(t.shape[1:])).contiguous().view(torch.uint8)
            for t in tensors]  # fmt: skip
    whole = all_gather_rows(torch.cat(rows, dim=1), group, stats, name)
    out, at = [], 0
    for t, r in zip(tensors, rows, strict=True):
        part = whole[:, at : at + r.shape[1]].contiguous().view(t.dtype)
        out.append(part.view(whole.shape[0], *t.shape[1:]))
        at += r.shape[1]
    return out
