"""Readers: rows of a preprocessed dataset -> a Batch, by numpy memmap or an NVIDIA DALI pipeline.

Both take a BatchPlan (hybridrec.data.order), a global step and a sample range [lo, hi) of that
step's global batch, and return the same Batch bit for bit: the stored arrays are already in
their final form (dense log-transformed float32, ids int32, labels uint8), so reading is
copying plus exact casts (ids -> int64, labels -> float32).

- MemmapReader: numpy slices of the memory-mapped arrays, one copy per contiguous run.
- DaliReader: a DALI pipeline per (plan, slice) whose three `fn.readers.numpy` operators read
  the batch's segments as regions of interest ([block, row] .. [block + 1, row_end] of the
  `[num_blocks, block_rows, ...]` files), fed step by step by an external source, then cast
  (on the GPU when DALI runs there). DALI runs on the CPU where there is no GPU
  (device_id=None). It is imported lazily: hybridrec works, and this reader raises a clear
  ImportError, without DALI installed. Pipelines are sequential; a non-consecutive step
  rebuilds the pipeline at that step, so random access still works (slowly).

Shapes: B = hi - lo samples; dense [B, F] float32, ids [B, H] int64 (Criteo: F = 13, H = 26;
a table's H = the sum of its tables' hotness, padding -1 kept), labels [B] float32.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from hybridrec.data.dataset import Dataset
from hybridrec.data.order import BatchPlan, merge_contiguous
from hybridrec.types import Batch

READERS = ("memmap", "dali")
DALI_INSTALL = (
    "pip install 'hybridrec[dali]' (nvidia-dali-cuda130; nvidia-dali-cuda120 for CUDA 12)"
)


class MemmapReader:
    """Batches by slicing the memory-mapped arrays."""

    name = "memmap"

    def __init__(self, dataset: Dataset) -> None:
        self.ds = dataset

    def read(self, plan: BatchPlan, step: int, lo: int, hi: int) -> Batch:
        segs = merge_contiguous(plan.segments(step, lo, hi))
        ds = self.ds
        for a, b in segs:
            ds.check_rows(a, b)
        labels = np.concatenate([ds.labels[a:b] for a, b in segs]).astype(np.float32)
        dense = np.concatenate([ds.dense[a:b] for a, b in segs])
        ids = np.concatenate([ds.categorical[a:b] for a, b in segs]).astype(np.int64)
        return Batch(torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(labels))

    def close(self) -> None:
        pass


def dali_available() -> tuple[bool, str]:
    """(True, version) when NVIDIA DALI imports, else (False, the reason)."""
    try:
        import nvidia.dali as dali
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return False, f"{type(e).__name__}: {e}"
    return True, str(dali.__version__)


class _Pipe:
    """One DALI pipeline reading consecutive steps of one (plan, slice), and where it is."""

    def __init__(self, pipe: Any, next_step: int) -> None:
        self.pipe, self.next_step = pipe, next_step


class DaliReader:
    """Batches from an NVIDIA DALI pipeline of numpy-reader region reads (see module docstring)."""

    name = "dali"

    def __init__(
        self,
        dataset: Dataset,
        device: str = "cpu",
        num_threads: int = 2,
        prefetch: int = 2,
        max_pipelines: int = 4,
    ) -> None:
        ok, why = dali_available()
        if not ok:
            raise ImportError(f"data.reader=dali needs NVIDIA DALI ({why}); {DALI_INSTALL}")
        if device not in ("cpu", "gpu"):
            raise ValueError(f"DALI device {device!r} is not one of: cpu, gpu")
        if device == "gpu" and not torch.cuda.is_available():
            raise ValueError("DALI device 'gpu' needs CUDA, which is not available here")
        self.ds, self.device = dataset, device
        self.num_threads, self.prefetch, self.max_pipelines = num_threads, prefetch, max_pipelines
        self._pipes: OrderedDict[tuple, _Pipe] = OrderedDict()
        self._lock = threading.Lock()

    def _build(self, plan: BatchPlan, start_step: int, lo: int, hi: int) -> _Pipe:
        from nvidia.dali import fn, types
        from nvidia.dali.pipeline import Pipeline

        ds, r = self.ds, self.ds.block_rows
        slots = plan.max_segments(hi - lo)

        def regions(info: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
            segs = plan.segments(start_step + info.iteration, lo, hi)
            assert len(segs) <= slots, (len(segs), slots)
            start = np.zeros((slots, 2), np.int32)
            end = np.zeros((slots, 2), np.int32)
            end[:, 0] = 1  # unused slots read rows [0, 0) of block 0: nothing
            for i, (a, b) in enumerate(segs):
                block = a // r
                start[i] = (block, a - block * r)
                end[i] = (block + 1, b - block * r)
            return list(start), list(end)

        device_id = torch.cuda.current_device() if self.device == "gpu" else None
        pipe = Pipeline(
            batch_size=slots,
            num_threads=self.num_threads,
            device_id=device_id,
            prefetch_queue_depth=max(1, self.prefetch),
        )
        with pipe:
            roi_start, roi_end = fn.external_source(
                source=regions, num_outputs=2, batch=True, batch_info=True
            )
            outputs = []
            for name in ("labels", "dense", "categorical"):
                x = fn.readers.numpy(
                    files=[str(ds.file(name).resolve())] * slots,
                    roi_start=roi_start,
                    roi_end=roi_end,
                    roi_axes=(0, 1),
                    out_of_bounds_policy="error",
                    random_shuffle=False,
                    name=f"read_{name}",
                )
                if self.device == "gpu":
                    x = x.gpu()
                if name == "labels":
                    x = fn.cast(x, dtype=types.FLOAT)
                elif name == "categorical":
                    x = fn.cast(x, dtype=types.INT64)
                outputs.append(x)
            pipe.set_outputs(*outputs)
        pipe.build()
        return _Pipe(pipe, start_step)

    def read(self, plan: BatchPlan, step: int, lo: int, hi: int) -> Batch:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        for a, b in merge_contiguous(plan.segments(step, lo, hi)):
            self.ds.check_rows(a, b)
        key = (plan.key, lo, hi)
        with self._lock:
            entry = self._pipes.pop(key, None)
            if entry is None or entry.next_step != step:
                entry = self._build(plan, step, lo, hi)
            self._pipes[key] = entry
            while len(self._pipes) > self.max_pipelines:
                self._pipes.popitem(last=False)
            labels_tl, dense_tl, ids_tl = entry.pipe.run()
            entry.next_step += 1
            n = hi - lo
            dev = (
                torch.device("cuda", torch.cuda.current_device()) if self.device == "gpu" else None
            )
            stream = torch.cuda.current_stream(dev) if dev is not None else None
            out = (
                torch.empty(n, dtype=torch.float32, device=dev),
                torch.empty(n, self.ds.dense.shape[1], dtype=torch.float32, device=dev),
                torch.empty(n, self.ds.categorical.shape[1], dtype=torch.int64, device=dev),
            )
            for tl, dst in zip((labels_tl, dense_tl, ids_tl), out, strict=True):
                row = 0
                for i in range(len(tl)):
                    t = tl[i]
                    k = t.shape()[1]
                    if k:
                        feed_ndarray(t, dst[row : row + k].view(1, k, *dst.shape[1:]), stream)
                        row += k
                assert row == n, (row, n)
        labels, dense, ids = out
        return Batch(dense, ids, labels)

    def close(self) -> None:
        with self._lock:
            self._pipes.clear()


def make_reader(name: str, dataset: Dataset, dali_device: str = "cpu") -> MemmapReader | DaliReader:
    if name == "memmap":
        return MemmapReader(dataset)
    if name == "dali":
        return DaliReader(dataset, dali_device)
    raise ValueError(f"data.reader={name!r} is not one of: {', '.join(READERS)}")
