"""Copy the next batch to the GPU while the current step runs.

`DevicePrefetcher(loader, device)` keeps one batch in flight: the host->device copy of batch
n+1 is issued on a side CUDA stream right after batch n is handed out, so it overlaps step n
(host tensors must be pinned for the copy to be asynchronous; the loaders pin them when CUDA
is present). Before a batch is used, the compute stream waits for its copy, and the tensors
are recorded on the compute stream so the allocator does not reuse them early. On CPU it is a
pass-through.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hybridrec.types import Batch


class DevicePrefetcher:
    """Wraps an iterator of host batches; yields batches already on `device`."""

    def __init__(self, loader: Iterator[Batch], device: torch.device) -> None:
        self.loader, self.device = loader, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._next: Batch | None = None

    def _issue(self) -> None:
        host = next(self.loader)
        if self.stream is None:
            self._next = host
            return
        with torch.cuda.stream(self.stream):
            self._next = host.to(self.device, non_blocking=True)

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Batch:
        if self._next is None:
            self._issue()
        batch, self._next = self._next, None
        assert batch is not None
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for t in (batch.dense, batch.ids, batch.labels):
                t.record_stream(current)
        try:
            self._issue()  # the next copy overlaps the step that uses `batch`
        except StopIteration:
            self._next = None
        return batch

    def close(self) -> None:
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()
