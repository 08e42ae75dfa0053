"""Every Triton kernel launch the ops make compiles for the H100 (sm_90), without a GPU.

Triton's CPU interpreter (the other kernel tests) runs kernels as numpy code, so it accepts
programs the compiler rejects, and it never sees the launch options. Here each public op runs
once per variant that training uses (table dtypes, widths, optional scale / count / row_sq,
weight decay of each mode, hot rows that need the merge kernel, host-row copies) under the interpreter, every launch is
recorded (kernel, argument types, constexprs, options), and each distinct launch is compiled
ahead of time to a cubin for sm_90 with Triton's bundled LLVM and ptxas: what the GPU would
JIT at the first step. A kernel that only works interpreted fails here, in CI.
"""

from __future__ import annotations

import inspect

import pytest
import torch

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
backends = pytest.importorskip("triton.backends.compiler")

from hybridrec.kernels import _common, host_copy, lookup, row_update, segment  # noqa: E402
from hybridrec.kernels.decay import DECOUPLED, L2, Decay  # noqa: E402
from hybridrec.optim.sparse import (  # noqa: E402
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseSGD,
)

# every row optimizer: each launches the row-update kernels with its own maths
OPTIMIZERS = (
    SparseSGD(0.1),
    RowWiseAdagrad(0.1, 1e-8),
    SparseAdam(0.01, 0.9, 0.999, 1e-8),
    SparseAdagrad(0.1, 1e-10),
)

TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "i1",
}
H100 = backends.GPUTarget("cuda", 90, 32)


def _arg_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {value!r}")


class _Recorder:
    """Stands in for a jitted kernel: `k[grid](*args, **kw)` records the launch, then runs the
    interpreted kernel so the op completes (and its later launches are recorded too)."""

    def __init__(self, fn, jitted, launches: dict) -> None:  # noqa: ANN001
        self.fn, self.jitted, self.launches = fn, jitted, launches

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            params = list(inspect.signature(self.fn).parameters)
            options = {k: kwargs[k] for k in ("num_warps", "enable_fp_fusion") if k in kwargs}
            constexprs = {k: v for k, v in kwargs.items() if k not in options}
            signature = {name: _arg_type(v) for name, v in zip(params, args, strict=False)}
            signature.update({name: "constexpr" for name in constexprs})
            key = (
                self.fn.__name__,
                tuple(signature.items()),
                tuple(sorted(constexprs.items())),
                tuple(sorted(options.items())),
            )
            self.launches.setdefault(key, (self.fn, signature, constexprs, options))
            return self.jitted[grid](*args, **kwargs)

        return launch


@pytest.fixture
def launches(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    found: dict = {}
    real = _common.jitted
    monkeypatch.setattr(_common, "jitted", lambda fn: _Recorder(fn, real(fn), found))
    return found


def _exercise_ops() -> None:
    """Each op once per variant training uses (small sizes: the interpreter is slow)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for width in (16, 48, 128):
            weight = torch.randn(40, width, generator=g).to(dtype)
            n = 2 * segment.SEGMENT_TILE  # two tiles (the tile kernel is the slow one here)
            rows = torch.randint(0, 40, (n,), generator=g)
            rows[: n - 16] = 3  # a row across tiles: its pieces need the fix-up kernel
            offsets = torch.linspace(0, n, 3).long()  # 2 bags of 32 ids: BLOCK_N 32
            bags = torch.arange(2).repeat_interleave(offsets.diff())
            for scale in (None, torch.rand(n, generator=g)):
                lookup.pooled_lookup(weight, rows, offsets, scale, 2)
                grad = torch.randn(2, width, generator=g)
                uniq, grads = segment.segment_grads(grad, rows, bags, scale)
                if dtype == torch.float32:  # its launches see fp32 gradients, whatever the table
                    segment.segment_grads_padded(grad, rows, bags, scale)
            for count in (None, torch.tensor([uniq.numel()])):
                for opt in OPTIMIZERS:
                    state = {
                        k: torch.zeros(v.shape(40, width)) for k, v in opt.state_spec().items()
                    }
                    row_update.update(opt, weight, state, uniq, grads, 1, count=count)
                    if opt.needs_full_row_stat:  # and with a given full-row statistic
                        row_sq = grads.pow(2).mean(1)
                        row_update.update(opt, weight, state, uniq, grads, 1, row_sq, count=count)
                    if width == 48 and dtype != torch.float16:  # weight decay: each branch
                        per_row = torch.rand(uniq.numel(), generator=g)
                        for decay in (Decay(L2, 0.0, per_row), Decay(DECOUPLED, 0.1, None, 0.1)):
                            row_update.update(
                                opt, weight, state, uniq, grads, 1, count=count, decay=decay
                            )
                            if opt.needs_full_row_stat:
                                row_update.update(
                                    opt, weight, state, uniq, grads, 1, row_sq, count=count,
                                    decay=decay,
                                )  # fmt: skip
            host_copy.copy_rows(weight, uniq, weight.clone(), uniq.flip(0))
    host_copy.copy_rows(torch.zeros(40), uniq, torch.ones(40), uniq.flip(0))  # row-wise state


def test_every_kernel_launch_compiles_for_sm90(launches, monkeypatch):
    _exercise_ops()
    kernels = {key[0] for key in launches}
    assert kernels == {
        "_pool_kernel",
        "_segment_tile_kernel",
        "_segment_fixup_kernel",
        "_tile_update_kernel",
        "_row_update_kernel",
        "_copy_kernel",
    }
    monkeypatch.delenv("TRITON_INTERPRET")  # triton.jit then builds compilable kernels
    failures = []
    for fn, signature, constexprs, options in launches.values():
        src = compiler.ASTSource(fn=triton.jit(fn), signature=signature, constexprs=constexprs)
        try:
            kernel = triton.compile(src, target=H100, options=options)
        except Exception as e:  # noqa: BLE001 - collect them all, report together
            failures.append(f"{fn.__name__} {constexprs} {options}: {str(e)[:2000]}")
            continue
        assert kernel.asm["cubin"], fn.__name__
    assert not failures, "\n\n".join(failures)
