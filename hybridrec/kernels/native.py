"""Native CPU kernels for the sparse backward: a hashing dedupe and in-place row updates
(and the library that also holds the dynamic tables' maps: native_map.py).

`native/sparse_rows.c` is plain C (no torch headers), compiled once per machine with the
system C compiler (`python -m hybridrec.kernels.native`; scripts/setup.sh runs it at install,
else the first use does) and called through ctypes with the tensors' data pointers. Results
are bit-identical to the torch path (tests/unit/test_native_rows.py): same sums in the same
order, torch's rounding. `lib()` is None when HYBRIDREC_NATIVE=0, no compiler is found or the
build fails (one warning), and callers then take the torch path: same results, slower.

`dedupe_hashed(rows, bags, scale, grad_pooled)` -> (rows [U] in first-occurrence order,
grads [U, D]), each row's gradient summed in id order as `cpu_rows.dedupe_sorted`'s.
`row_update(kernel, ...)`: one row optimizer's step on weight rows `idx` [U] (unique) in
place, reading and writing each touched row once; every optimizer's C function has one
signature (see sparse_rows.c), so an optimizer names its kernel (`native = "hr_adam"`) and
nothing here changes when one is added. They take CPU fp32 contiguous tensors (`usable`); the
library lives in the cache dir (HYBRIDREC_CACHE_DIR, else $XDG_CACHE_HOME/hybridrec or
~/.cache/hybridrec), named by source, compiler and CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)
# one library of every source: the sparse backward, and the dynamic tables' maps (native_map.py)
SOURCES = tuple(Path(__file__).with_name("native") / n for n in ("sparse_rows.c", "dynamic_map.c"))
# -ffp-contract=off: every product and sum rounded on its own, as torch's separate ops;
# -fno-math-errno lets sqrtf vectorise (its argument is never negative here)
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
_I64, _F32 = ctypes.c_int64, ctypes.c_float
_P = ctypes.c_void_p
_SIGNATURES = {"hr_dedupe": ([_P, _P, _P, _F32, _P, _I64, _I64, _P, _P], _I64)}
# every row update: (w, state pointers, idx, g, stat or NULL, u, d, scalars,
# decay kind, wd, decay lr, wd per row or NULL)
_ROW_UPDATE = ([_P, _P, _P, _P, _P, _I64, _I64, _P, _I64, _F32, _F32, _P], None)
NO_DECAY = (0, 0.0, 0.0, None)  # row_update's decay=: (kind, wd, lr, wd per row or None)
_state: dict[str, ctypes.CDLL | None] = {}
_off = [False]  # `disabled()` in force


def cache_dir() -> Path:
    if os.environ.get("HYBRIDREC_CACHE_DIR"):
        return Path(os.environ["HYBRIDREC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybridrec"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its flags (Linux), else the arch."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def library_path(cc: str) -> Path:
    key = hashlib.sha256()
    parts = [*(s.read_bytes() for s in SOURCES), cc.encode(), " ".join(FLAGS).encode()]
    for part in (*parts, _cpu_id().encode()):
        key.update(part)
    return cache_dir() / f"sparse_rows-{key.hexdigest()[:16]}.so"


def build(cc: str | None = None) -> Path:
    """Compile the sources into one library in the cache dir (if not there yet) and return
    its path. Tries -march=native first, then without it. Raises RuntimeError with the
    compiler's message."""
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    target = library_path(cc)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for extra in (["-march=native"], []):
        # built under a temporary name, then renamed: ranks building at once never load half a file
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [cc, *FLAGS, *extra, *map(str, SOURCES), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode == 0:
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
        errors.append(done.stderr.strip().splitlines()[-1:] or ["(no message)"])
    raise RuntimeError(f"{cc} could not build the CPU kernels: {errors[-1][0]}")


def lib() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; None (and one warning) where they cannot be,
    and inside `disabled()`."""
    if _off[0]:
        return None
    if "lib" in _state:
        return _state["lib"]
    loaded = None
    if os.environ.get("HYBRIDREC_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off"):
        try:
            path = build()
            loaded = ctypes.CDLL(str(path))
            for name, (args, res) in _SIGNATURES.items():
                fn = getattr(loaded, name)
                fn.argtypes, fn.restype = args, res
        except (RuntimeError, OSError) as e:
            log.warning(
                "CPU sparse kernels unavailable (%s); using torch ops: same results, slower", e
            )
            loaded = None
    _state["lib"] = loaded
    return loaded


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """The torch path inside the block (tests and benchmarks compare the two in one process)."""
    previous, _off[0] = _off[0], True
    try:
        yield
    finally:
        _off[0] = previous


def usable(*tensors: torch.Tensor | None, inplace: tuple[torch.Tensor, ...] = ()) -> bool:
    """True when the native kernels can take these tensors and the library loads: all on the
    CPU, fp32 or int64 (ids), none requiring grad; `inplace` ones (weights, optimizer state,
    written in place) also contiguous. Inputs need not be contiguous (copied if not)."""
    for t in (*tensors, *inplace):
        if t is None:
            continue
        if t.device.type != "cpu" or t.requires_grad or t.dtype not in (torch.float32, torch.int64):
            return False
    if not all(t.is_contiguous() for t in inplace):
        return False
    return lib() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def dedupe_hashed(
    rows: torch.Tensor,
    bags: torch.Tensor,
    scale: torch.Tensor | float | None,
    grad_pooled: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [U] in first-occurrence order, grads [U, D] fp32): grad_pooled[bags[i]] * scale[i]
    summed per distinct row in id order, from 0. Callers check `usable` first."""
    n, d = rows.numel(), grad_pooled.shape[1]
    scale_t = scale if isinstance(scale, torch.Tensor) else None
    scale_all = 1.0 if scale is None or scale_t is not None else float(scale)
    rows, bags = rows.contiguous(), bags.contiguous()
    grad = grad_pooled.float().contiguous()
    if scale_t is not None:
        scale_t = scale_t.float().contiguous()
    uniq = torch.empty(n, dtype=torch.int64)
    out = torch.empty(n, d, dtype=torch.float32)
    lib_ = lib()
    assert lib_ is not None, "call usable() first"
    u = lib_.hr_dedupe(
        _ptr(rows), _ptr(bags), _ptr(scale_t), scale_all, _ptr(grad), n, d, _ptr(uniq), _ptr(out)
    )
    if u < 0:
        raise MemoryError(f"out of memory deduplicating {n} ids")
    return uniq[:u], out[:u]


def function(name: str, signature: tuple[list, object]) -> ctypes._CFuncPtr | None:
    """The loaded library's function `name` (None: it has none), typed on first use with
    `signature` (argtypes, restype). Callers check `lib()` first."""
    lib_ = lib()
    assert lib_ is not None, "call usable() first"
    fn = getattr(lib_, name, None)
    if fn is not None and fn.argtypes is None:
        fn.argtypes, fn.restype = signature
    return fn


def _kernel(name: str) -> ctypes._CFuncPtr:
    """The row update `name` of the loaded library."""
    fn = function(name, _ROW_UPDATE)
    if fn is None:
        raise ValueError(f"{SOURCES[0].name} has no row update {name!r} (an optimizer's `native`)")
    return fn


def row_update(
    kernel: str,
    weight: torch.Tensor,
    states: list[torch.Tensor],
    idx: torch.Tensor,
    grads: torch.Tensor,
    stat: torch.Tensor | None,
    scalars: tuple[float, ...],
    decay: tuple[int, float, float, torch.Tensor | None] = NO_DECAY,
) -> None:
    """One step of the row optimizer whose C function is `kernel` (an `hr_*` of sparse_rows.c)
    on weight rows idx [U] (unique), in place: weight [R, D] and `states` (its state in
    state_spec order, [R] or [R, D]) CPU fp32 contiguous (callers check `usable`); grads
    [U, D] fp32; stat [U] each row's mean(g^2) over its full width, or None; `scalars`
    rounded to fp32 as ctypes rounds. `decay`: (kind, wd, lr, wd_rows [U] or None), as
    hybridrec.kernels.rows.Decay (0: none, 1: L2, 2: decoupled)."""
    idx, grads = idx.contiguous(), grads.contiguous()  # kept alive over the call
    assert idx.dtype == torch.int64 and grads.shape == (idx.numel(), weight.shape[1])
    if stat is not None:
        stat = stat.float().contiguous()
    kind, wd, lr, wd_rows = decay
    if wd_rows is not None:
        wd_rows = wd_rows.float().contiguous()
        assert wd_rows.shape == (idx.numel(),)
    state_ptrs = (_P * max(1, len(states)))(*[t.data_ptr() for t in states])
    h = (_F32 * max(1, len(scalars)))(*scalars)
    _kernel(kernel)(
        _ptr(weight),
        state_ptrs,
        _ptr(idx),
        _ptr(grads),
        _ptr(stat),
        idx.numel(),
        weight.shape[1],
        h,
        int(kind),
        float(wd),
        float(lr),
        _ptr(wd_rows),
    )


def main() -> int:
    """Build the kernels now (scripts/setup.sh calls this at install); 0 also when no compiler
    is found, since the torch path then runs instead."""
    try:
        print(f"hybridrec: CPU sparse kernels at {build()}")
    except RuntimeError as e:
        print(f"hybridrec: CPU sparse kernels not built ({e}); the torch path will be used")
    return 0


if __name__ == "__main__":
    sys.exit(main())
