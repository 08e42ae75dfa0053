"""What the kernels share: the triton import, jitting per mode, argument checks, launch sizes,
and the one rounding of fp32 results to the weight's dtype, written once per language.

Rounding follows torch's CPU ops: fp32 products and sums are rounded separately (launched with
enable_fp_fusion=False), the weight step w - lr * delta is one fma (as torch's index_add_ /
sub_ with alpha), sqrt and division are IEEE (sqrt_rn, div_rn), and each stored value is
rounded once: `round_for_store` in kernels (bf16 to nearest even by hand: Triton's interpreter
truncates), `round_to` on the torch path (torch's cast, also to nearest even).

Triton picks interpreted or compiled mode when a function is jitted. `jitted` jits kernels on
first use, once per mode, so TRITON_INTERPRET may be set after import; Triton's own @jit library
functions (tl.zeros, tl.sum, ...) are jitted at `import triton` in that moment's mode, so the
kernels use builtins (tl.full; tl.reduce with triton's sum combiner) and `device_function`s.
`triton` and `tl` are None where triton does not import: callers check `available` first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install: fall back to the torch path
    triton = None
    tl = None

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_BLOCK_D = 128  # columns per program (wider rows take several column blocks)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


_JITTED: dict[tuple[Callable, bool], Any] = {}


def jitted(fn: Callable) -> Any:
    """Kernel `fn` jitted for the current mode (interpreted or compiled), once per mode. The ops
    call it as `_common.jitted(...)`: tests wrap every launch by patching this one name."""
    if triton is None:
        raise RuntimeError("triton is not installed; use the torch path (see available())")
    key = (fn, _interpreting())
    if key not in _JITTED:
        _JITTED[key] = triton.jit(fn)
    return _JITTED[key]


if triton is not None:
    from triton.runtime.interpreter import InterpretedFunction

    class _DeviceFunction(triton.JITFunction):
        """A compiled JITFunction (what the compiler inlines into a calling kernel) whose call
        from Python, which is how an interpreted kernel calls it, runs it interpreted."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if not hasattr(self, "_interpreted"):
                self._interpreted = InterpretedFunction(self.fn)
            return self._interpreted(*args, **kwargs)


def device_function(fn: Callable) -> Any:
    """@triton.jit for a function kernels call, callable from kernels of either mode (a plain
    @triton.jit one would be of the mode at import, wrong for kernels of the other)."""
    return _DeviceFunction(fn) if triton is not None else None


@device_function
def round_for_store(x, ptr):  # noqa: ANN001, ANN201
    """fp32 `x` rounded once to the element type of `ptr`: bf16 to nearest even by hand (the
    interpreter's cast truncates; NaN stays a quiet NaN), others by Triton's cast."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(x != x, 0x7FC0, bits)
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(ptr.dtype.element_ty)
    return out


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `x` rounded once to `dtype` (to nearest even): the torch path's twin of
    `round_for_store`, bit for bit."""
    return x.to(dtype)


# --------------------------------------------------------------------------------------------
# Input checks (ValueError with the expected shape and dtype) and launch sizes.


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_device(ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if not ref.is_cuda and not _interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU ones), got "
            f"{ref.device}"
        )
    for name, t in tensors.items():
        if t is not None:
            _require(t.device == ref.device, f"{name} is on {t.device}, expected {ref.device}")


def _check_weight(weight: torch.Tensor) -> None:
    _require(
        weight.dim() == 2 and weight.dtype in WEIGHT_DTYPES,
        f"weight must be [R, D] fp32/bf16/fp16, got {tuple(weight.shape)} {weight.dtype}",
    )
    _require(weight.is_contiguous(), "weight must be contiguous (it is indexed as row * D)")


def _check_ids(name: str, t: torch.Tensor, n: int | None = None) -> torch.Tensor:
    _require(
        t.dim() == 1 and t.dtype == torch.int64,
        f"{name} must be a 1-d int64 tensor, got {tuple(t.shape)} {t.dtype}",
    )
    if n is not None:
        _require(t.numel() == n, f"{name} must have {n} entries, got {t.numel()}")
    return t.contiguous()


def _check_vector(name: str, t: torch.Tensor, n: int) -> torch.Tensor:
    _require(
        t.dim() == 1 and t.dtype == torch.float32 and t.numel() == n,
        f"{name} must be [{n}] fp32, got {tuple(t.shape)} {t.dtype}",
    )
    return t.contiguous()


def _block_d(width: int) -> int:
    return min(triton.next_power_of_2(max(width, 1)), MAX_BLOCK_D)


def _opts(elements: int) -> dict:
    """Launch options for a tile of `elements` values: 4 per thread (1 to 8 warps), and no
    contraction of a * b + c into fma: the kernels round like torch's ops, fusing only where
    torch fuses (tl.fma in the weight updates)."""
    return {"num_warps": max(1, min(8, elements // 128)), "enable_fp_fusion": False}
