"""Which path the embedding ops take in this process: Triton kernels or torch ops.

`train.kernels` (KERNEL_MODES, set once per process by `set_kernels`): auto = Triton where it
can run (CUDA, or CPU tensors under TRITON_INTERPRET=1), torch = never Triton, triton = Triton,
refused where it cannot run instead of silently using torch. `available(t)` answers per tensor:
triton importable, `t` on CUDA or the interpreter on, and neither train.kernels=torch nor
HYBRIDREC_KERNELS=torch in the environment. `use_kernels` sets a mode for one block.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from hybridrec.kernels._common import _interpreting, triton

KERNEL_MODES = ("auto", "torch", "triton")
_mode = "auto"  # set once per process from the config (train.kernels) by set_kernels()


def set_kernels(mode: str, device: torch.device | None = None) -> None:
    """Choose the embedding kernels for this process (`train.kernels`): auto (Triton where it
    can run: CUDA, or CPU under TRITON_INTERPRET=1), torch (never Triton) or triton (refused
    where it cannot run, instead of silently using torch)."""
    global _mode
    if mode not in KERNEL_MODES:
        raise ValueError(f"train.kernels={mode!r} is not one of: {', '.join(KERNEL_MODES)}")
    if mode == "triton":
        if triton is None:
            raise ValueError("train.kernels=triton, but triton is not installed")
        if device is not None and device.type != "cuda" and not _interpreting():
            raise ValueError(
                f"train.kernels=triton needs a CUDA device (or TRITON_INTERPRET=1 to run the "
                f"kernels in Triton's CPU interpreter, for tests); the device is {device}"
            )
    _mode = mode


@contextlib.contextmanager
def use_kernels(mode: str) -> Iterator[None]:
    """set_kernels(mode) inside the block, the previous choice after it (benchmarks and
    tests that time or compare both paths in one process)."""
    previous = _mode
    set_kernels(mode)
    try:
        yield
    finally:
        set_kernels(previous)


def available(t: torch.Tensor) -> bool:
    """True when the Triton kernels run on tensors like `t` (see the module docstring)."""
    if triton is None or _mode == "torch":
        return False
    if os.environ.get("HYBRIDREC_KERNELS", "").strip().lower() == "torch":
        return False
    return t.is_cuda or _interpreting()
