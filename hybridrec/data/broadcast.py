"""The rank-0 broadcasting loader: one rank reads and parses, every rank keeps its slice.

Rank 0 of the group reads and packs each global batch in a background thread, `prefetch`
batches ahead (the packed buffer pinned for NCCL, so its copy to the GPU is asynchronous),
and broadcasts it in two phases, as Megatron does:

1. a header, int64 [7]: status (OK, END of a finite split, ERROR reading), step, B (rows),
   F (dense columns), H (ids per row), bytes per id (4 or 8), payload bytes;
2. one flat uint8 payload: ids [B, H] as int32 when every id of the batch fits (always, for
   tables under 2**31 rows: 40% less to send for Criteo than int64; an id that does not fit,
   bad data, makes the batch go as int64 so its range check still sees it), then dense
   [B, F] float32, then labels [B] float32 (ids first keeps every view aligned).

Every rank then keeps rows [r*B/W, (r+1)*B/W). The tensors live on the device the group's
backend needs (CUDA for NCCL, CPU for gloo), so this works on CPU-only machines. Broadcasts
run in the caller's thread, in step order, so they never interleave with the training step's
own collectives; they inherit the group's timeout, so a dead rank 0 ends the job with an
error instead of a hang. A read error on rank 0 is announced in the header before rank 0
raises it, so the other ranks fail at once, naming the step. Every rank checks the header's
step against its own position (a desynchronised loader is an error, not silent bad data).

With one rank, or no process group, it is a prefetching reader (batches pinned when CUDA
is there). Receivers copy their slice out of the payload (own storage per tensor).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from hybridrec.data.loader import (
    BatchSource,
    Prefetcher,
    epoch_limit,
    padded,
    pin_default,
    pinned,
    rank_span,
)
from hybridrec.distributed.comm import broadcast
from hybridrec.types import Batch

OK, END, ERROR = 0, 1, 2
HEADER = 7
_INT32 = torch.iinfo(torch.int32)


def comm_device(group: dist.ProcessGroup) -> torch.device:
    """Where broadcast tensors must live for `group`'s backend."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pack(batch: Batch) -> tuple[torch.Tensor, int]:
    """Batch -> (one flat uint8 tensor: ids, dense, labels; bytes per id), as the module
    docstring says."""
    ids = batch.ids
    fits = True
    if ids.numel():
        low, high = torch.aminmax(ids)  # one pass
        fits = int(low) >= _INT32.min and int(high) <= _INT32.max
    id_dtype = torch.int32 if fits else torch.int64
    parts = [ids.to(id_dtype), batch.dense.to(torch.float32), batch.labels.to(torch.float32)]
    # flat first: a batch without dense columns has dense [B, 0], whose stride view() refuses
    payload = torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])
    return payload, id_dtype.itemsize


def unpack(
    payload: torch.Tensor, rows: int, dense_cols: int, id_cols: int, id_bytes: int = 8
) -> Batch:
    """The payload's tensors as views (ids in their wire dtype: int32 or int64)."""
    id_dtype = torch.int32 if id_bytes == 4 else torch.int64
    n_ids, n_dense = rows * id_cols * id_bytes, rows * dense_cols * 4
    ids = payload[:n_ids].view(id_dtype).view(rows, id_cols)
    dense = payload[n_ids : n_ids + n_dense].view(torch.float32).view(rows, dense_cols)
    labels = payload[n_ids + n_dense : n_ids + n_dense + rows * 4].view(torch.float32)
    return Batch(dense, ids, labels)


class BroadcastLoader:
    """Rank 0 reads global batches and broadcasts them; each rank yields its slice."""

    def __init__(
        self,
        source: BatchSource,
        rank: int,
        world_size: int,
        batch_size: int,
        split: str = "train",
        start_step: int = 0,
        group: dist.ProcessGroup | None = None,
        prefetch: int = 2,
        pin_memory: bool | None = None,
    ) -> None:
        self.lo, self.hi, self.n = rank_span(batch_size, world_size, rank, split)
        if world_size > 1 and group is None:
            raise ValueError("data.loader=broadcast with several ranks needs a process group")
        self.source, self.rank, self.world, self.group = source, rank, world_size, group
        self.batch_size, self.split, self.position = batch_size, split, start_step
        self.distributed = group is not None and world_size > 1
        self.device = comm_device(group) if self.distributed else torch.device("cpu")
        self.src = dist.get_global_rank(group, 0) if self.distributed else 0
        self.pin = pin_default() if pin_memory is None else pin_memory
        self._prefetch: Prefetcher | None = None
        if rank == 0:
            limit = epoch_limit(source, batch_size, split)
            self._prefetch = Prefetcher(self._read, start_step, limit, prefetch)

    def _read(self, step: int) -> Batch | tuple[Batch, torch.Tensor]:
        """Rank 0, in the prefetch thread: the batch (and its packed, pinned payload)."""
        batch = self.source.batch(step, self.batch_size, self.split)
        if not self.distributed:
            return pinned(batch, self.pin)
        payload, id_bytes = pack(batch)
        if self.pin and self.device.type == "cuda":
            payload = payload.pin_memory()  # so the copy to the GPU for NCCL is asynchronous
        return batch, payload, id_bytes

    def __iter__(self) -> Iterator[Batch]:
        return self

    def _header(
        self, status: int, step: int, shape: tuple[int, int, int], id_bytes: int, nbytes: int
    ) -> torch.Tensor:
        values = [status, step, *shape, id_bytes, nbytes]
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def __next__(self) -> Batch:
        if not self.distributed:
            assert self._prefetch is not None
            status, step, value = self._prefetch.get()
            if status == "end":
                raise StopIteration
            if status == "error":
                raise value  # type: ignore[misc]
            self.position = step + 1
            return value  # type: ignore[return-value]
        if self.rank == 0:
            return self._send()
        return self._receive()

    def _send(self) -> Batch:
        assert self._prefetch is not None
        status, step, value = self._prefetch.get()
        if status != "ok":
            code = END if status == "end" else ERROR
            header = self._header(code, step, (0, 0, 0), 0, 0)
            broadcast(header, self.src, self.group, "batch_broadcast")
            if status == "end":
                raise StopIteration
            raise value  # type: ignore[misc]
        batch, host, id_bytes = value  # type: ignore[misc]
        shape = (batch.size, batch.dense.shape[1], batch.ids.shape[1])
        payload = host.to(self.device, non_blocking=True)
        header = self._header(OK, step, shape, id_bytes, payload.numel())
        broadcast(header, self.src, self.group, "batch_broadcast")
        broadcast(payload, self.src, self.group, "batch_broadcast")
        self.position = step + 1
        if self.device.type == "cuda":  # rank 0's slice is on the GPU already
            return self._own(self._slice(unpack(payload, *shape, id_bytes)))
        return self._slice(batch)

    def _receive(self) -> Batch:
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
        broadcast(header, self.src, self.group, "batch_broadcast")
        status, step, rows, dense_cols, id_cols, id_bytes, nbytes = header.tolist()
        if status == END:
            raise StopIteration
        if status == ERROR:
            raise RuntimeError(
                f"rank 0 failed to read global batch {step} of split {self.split!r} "
                "(its own error says why)"
            )
        if step != self.position:
            raise RuntimeError(
                f"broadcast loader out of step: rank 0 sent batch {step}, rank {self.rank} "
                f"expected {self.position}"
            )
        payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        broadcast(payload, self.src, self.group, "batch_broadcast")
        self.position = step + 1
        return self._own(self._slice(unpack(payload, rows, dense_cols, id_cols, id_bytes)))

    @staticmethod
    def _own(views: Batch) -> Batch:
        """Own storage per tensor (not dtype views of one buffer: frees the rest of the
        payload), ids back to int64."""
        return Batch(views.dense.clone(), views.ids.to(torch.int64), views.labels.clone())

    def _slice(self, batch: Batch) -> Batch:
        return padded(batch.slice(self.lo, self.hi), self.n)

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()
