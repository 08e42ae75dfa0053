"""Host syncs counted on the CPU: `SyncRecorder` records, while active on this thread, every
op that would make a CUDA program wait for the device, attributed to the hybridrec line that
issued it (tests/unit/test_no_sync_ops.py says what and why; tests/unit/test_host_syncs.py
counts a host cache's). `unrecorded_launches` keeps Triton's CPU interpreter, whose own
tensor handling during a launch is not the step's, out of the record.

Two recorders together: a TorchFunctionMode for Python-level calls (.item(), .tolist(),
bool(), int(), float(), .cpu(), .numpy(); boolean-mask indexing; a Python scalar written
through a tensor index, which on CUDA is copied from pageable host memory, a sync), also
inside custom autograd Functions' backward (the sparse update), where autograd turns such
modes off; and a TorchDispatchMode for aten ops whose output size depends on the data
(nonzero, unique, masked_select, boolean index or index_put, bincount, repeat_interleave
without output_size), that read a value (_local_scalar_dense, is_nonzero, equal) or that
write one value through an index (index_put of a 0-dim tensor: what `t[i] = 1.0` becomes),
including those torch issues inside other calls. Copies to the host made some other way are
invisible on the CPU; the GPU tests see them.

`ALLOWED` are the documented sync points (docs/host-cache.md, "Host syncs").
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import hybridrec
from hybridrec.kernels import _common

HYBRIDREC_ROOT = str(Path(hybridrec.__file__).parent)

SYNCING_ATEN = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::unique_dim_consecutive",
    "aten::masked_select",
    "aten::is_nonzero",
    "aten::equal",
    "aten::bincount",
    "aten::histc",
}
INDEX_ATEN = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
READS = {
    torch.Tensor.tolist: "tolist",
    torch.Tensor.item: "item",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
}
# The documented sync points: (file, function, op) -> what it is
ALLOWED = {
    ("cache.py", "_admit", "tolist"): "an admission's one read (distinct rows and misses)",
    ("cache.py", "_choose_slots", "int"): "an unforeseen eviction: how many slots may go",
    ("sample_major.py", "sample_major_inputs", "aten::nonzero"): "one rank: a list's real ids",
}


@dataclass(frozen=True)
class Sync:
    """One flagged op: what it is and the hybridrec line that issued it."""

    op: str
    file: str
    function: str
    line: int

    @property
    def allowed(self) -> bool:
        return (self.file, self.function, self.op) in ALLOWED

    def __str__(self) -> str:
        return f"{self.op} at {self.file}:{self.line} ({self.function})"


def _caller() -> tuple[str, str, int]:
    """(file name, function, line) of the innermost hybridrec frame issuing the current op
    (frames of torch, triton and the tests skipped); ("<outside hybridrec>", "", 0) if none."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(HYBRIDREC_ROOT):
            return Path(name).name, frame.f_code.co_name, frame.f_lineno
        frame = frame.f_back
    return "<outside hybridrec>", "", 0


def _has_bool(index: object) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _values(args: tuple, kwargs: dict) -> torch.Tensor:
    """index_put's values argument."""
    return args[2] if len(args) > 2 else kwargs["values"]


def _has_tensor(index: object) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) for i in items)


class SyncRecorder:
    """Records, while active (on this thread), every op that makes CUDA wait for the device
    (module docstring). `syncs`: in order; `total`: aten ops seen (the step was recorded)."""

    def __init__(self) -> None:
        self.syncs: list[Sync] = []
        self.total = 0
        self._inside = 0  # in a flagged Python call: its own aten ops are the same sync
        self._modes = (_Calls(self), _AtenOps(self))

    def add(self, op: str) -> None:
        self.syncs.append(Sync(op, *_caller()))

    def __enter__(self) -> SyncRecorder:
        for mode in self._modes:
            mode.__enter__()
        # autograd runs a custom Function's backward (the sparse update) with the Python-level
        # mode off: turn it on there too
        calls, real = self._modes[0], BackwardCFunction.apply

        def apply(node, *args):  # noqa: ANN001, ANN002, ANN202
            with calls:
                return real(node, *args)

        self._real_apply = real
        BackwardCFunction.apply = apply  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        BackwardCFunction.apply = self._real_apply  # type: ignore[method-assign]
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def unexpected(self) -> list[str]:
        return [str(s) for s in self.syncs if not s.allowed]

    def allowed(self) -> Counter[str]:
        return Counter(f"{s.function}.{s.op}" for s in self.syncs if s.allowed)


class _Calls(TorchFunctionMode):
    def __init__(self, rec: SyncRecorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        op = READS.get(func)
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
            if _has_bool(args[1]):
                op = "boolean mask index"
            elif (
                func is torch.Tensor.__setitem__
                and _has_tensor(args[1])
                and isinstance(args[2], (bool, int, float))
            ):
                op = "Python scalar written through a tensor index"
        if op is None:
            return func(*args, **kwargs)
        self.rec.add(op)
        self.rec._inside += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.rec._inside -= 1


class _AtenOps(TorchDispatchMode):
    def __init__(self, rec: SyncRecorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = func._schema.name
        self.rec.total += 1
        op = None
        if name in SYNCING_ATEN:
            op = name
        elif name in INDEX_ATEN and _has_bool(args[1] if len(args) > 1 else kwargs["indices"]):
            op = f"{name} (boolean mask)"
        elif name in INDEX_ATEN and name != "aten::index" and _values(args, kwargs).dim() == 0:
            op = f"{name} of one value (a Python scalar: copied from pageable host memory)"
        elif name == "aten::repeat_interleave" and kwargs.get("output_size") is None:
            op = f"{name} without output_size"
        if op is not None and not self.rec._inside:
            self.rec.add(op)
        return func(*args, **kwargs)


def unrecorded_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton launches (hybridrec.kernels._common.jitted) run with both recorders off."""
    real = _common.jitted

    class Unrecorded:
        def __init__(self, kernel) -> None:  # noqa: ANN001
            self.kernel = kernel

        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                with _disable_current_modes(), torch._C.DisableTorchFunction():
                    return self.kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(_common, "jitted", lambda fn: Unrecorded(real(fn)))
