"""Several all-gathers in one collective: tensors of any dtypes and shapes packed as bytes.

On CPU/gloo a collective's fixed cost (about a millisecond of CPU per call on a 2-core machine,
whatever its size at these sizes) outweighs the bytes of the small tensors exact mode gathers
(hybridrec.exact: a step's outputs and targets; then the replicated tables' ids and gradients
with the dense partial gradients, hybridrec.sparse.exact.replicas), so they travel together.
Moving bytes changes no bit.
"""

from __future__ import annotations

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
    """Tensors [n_i, ...] (any dtypes, bool included; each the same shape on every rank) ->
    each one's [W * n_i, ...], rank p's rows at block p, as `all_gather_rows` gives, by one
    all-gather of their bytes (each tensor itself on a one-rank group)."""
    if world_size(group) == 1 or not tensors:
        return list(tensors)
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(f"all_gather_packed gathers rows, got {[list(t.shape) for t in tensors]}")
    flat = [t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]
    whole = all_gather_rows(torch.cat(flat).view(1, -1), group, stats, name)  # [W, bytes]
    out, at = [], 0
    for t, f in zip(tensors, flat, strict=True):
        shape = (whole.shape[0] * t.shape[0], *t.shape[1:])
        if f.numel() == 0:  # no bytes: nothing to view
            out.append(t.new_empty(shape))
            continue
        part = whole[:, at : at + f.numel()].contiguous().view(t.dtype)
        out.append(part.view(shape))
        at += f.numel()
    return out
