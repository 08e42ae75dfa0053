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

import numpy as np
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
        if key[1]:
            _interpreter_compat()
        _JITTED[key] = triton.jit(fn)
    return _JITTED[key]


def _fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """x * y + z of fp32 arrays rounded once to fp32, as a hardware fma (musl's fmaf, in
    numpy): the fp64 product is exact, the fp64 sum rounds once, and where that sum is
    inexact and falls exactly halfway between two fp32 values, one fp64 ulp toward the exact
    value keeps the second rounding from going the wrong way. Results in fp32's normal range
    (every value the kernels fma) are exact."""
    x, y, z = (np.asarray(a, dtype=np.float64) for a in np.broadcast_arrays(x, y, z))
    xy = x * y
    r = xy + z
    bits = r.view(np.uint64).copy()
    with np.errstate(invalid="ignore"):
        fix = ((bits & 0x1FFFFFFF) == 0x10000000) & np.isfinite(r)
        fix &= ~((r - xy == z) & (r - z == xy))
    if fix.any():
        neg = (bits >> 63).astype(bool)
        err = np.where(neg == (z > xy), xy - r + z, z - r + xy)
        step = np.where(neg == (err < 0), 1, -1).astype(np.int64).view(np.uint64)
        bits = np.where(fix, bits + step, bits)
    return bits.view(np.float64).astype(np.float32)


def _interpreter_compat() -> None:
    """Make Triton's CPU interpreter before 3.9 run the kernels as 3.9's does, once: its
    scalars are 1-element arrays, and `int()` of one (what range() over a runtime bound calls,
    via __index__) is a TypeError from NumPy 2.4 on (fixed in Triton 3.8); and its tl.fma
    rounds twice (x * y, then + z; exact from 3.9), where the kernels' bits rely on one
    rounding, as torch's CPU ops and the GPU's fma round. A no-op on newer Triton."""
    from triton.runtime import interpreter as interp

    if getattr(interp, "_hybridrec_compat", False):
        return
    interp._hybridrec_compat = True
    patch_tensor = getattr(interp, "_patch_lang_tensor", None)
    if patch_tensor is not None:

        def _patch_lang_tensor(tensor: Any, scope: Any) -> None:
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

        interp._patch_lang_tensor = _patch_lang_tensor
    builder = getattr(interp, "InterpreterBuilder", None)
    exact = hasattr(getattr(interp, "_interpreter", None), "fma_fp32")  # from Triton 3.9
    if builder is not None and not exact:
        inexact = builder.create_fma

        def create_fma(self: Any, x: Any, y: Any, z: Any) -> Any:
            if z.data.dtype != np.float32:
                return inexact(self, x, y, z)
            return interp.TensorHandle(_fma32(x.data, y.data, z.data), z.dtype.scalar)

        builder.create_fma = create_fma


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
