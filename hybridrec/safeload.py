"""Reading files as data only: a file never runs code when hybridrec loads it.

`load_tensors` is torch.load with `weights_only=True`: tensors, numbers, strings, None,
lists, tuples and dicts come back; anything else a pickle can hold (a callable such as
os.system, an object of an unknown class, a numpy array) is refused before it is built,
with one line naming the file and the globals it names. Checkpoints, exports and
warm-start files go through it; their callers add what to do next.

`load_convertible` is the same loader with one allowlist more, numpy's arrays, scalars and
dtypes (what an older writer pickled): the checkpoint conversion reads files with it, so
it, too, never builds anything else and never runs code from a file. An UnsafeFileError
says whether the file holds only such numpy data (`convertible`): then the conversion can
help, otherwise (a pickled callable, an unknown class) nothing can, and no message
suggests it.

Dataset files are read with `np.load(..., allow_pickle=False)` at each call site (object
arrays are refused there, naming the file).
"""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

_REFUSED = re.compile(r"GLOBAL ([\w.]+)|global ([\w.]+)|Unsupported operand (\d+)")
NUMPY_DATA = "numpy arrays, scalars and dtypes"
# torch.save's legacy (pre-1.6) format opens with this number, pickled; the zip format with
# a zip header. Anything else (a plain pickle.dump, text) was not written by torch.save.
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_ZIP_MAGIC = b"PK\x03\x04"


class UnsafeFileError(ValueError):
    """A file holding more than data (a pickled callable, an unknown global): refused.
    `reason` is the message without the path, for callers that name the file their way;
    `globals` the pickled globals it names beyond data (what was refused); `convertible`
    whether they are all numpy data, which `load_convertible` reads."""

    def __init__(self, path: Path, reason: str, names: list[str], convertible: bool) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason
        self.globals, self.convertible = names, convertible


def _numpy_globals() -> list[Any]:
    """What pickled numpy data names, as torch's allowlist takes it: numpy 2 pickles
    `numpy._core.multiarray._reconstruct`, numpy 1 `numpy.core.multiarray._reconstruct`
    (the same function, so listed under both names); every dtype has its own class."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1
        from numpy.core import multiarray  # type: ignore[no-redef]
    dtypes = {type(np.dtype(c)) for c in np.typecodes["All"]}
    dtypes |= {type(np.dtype(c)) for c in ("U1", "S1", "V1", "O", ">f8")}
    out: list[Any] = [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *dtypes]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        for f in (multiarray._reconstruct, multiarray.scalar):
            if f.__module__ != module:
                out.append((f, f"{module}.{f.__name__}"))
    return out


def _name(g: Any) -> str:
    return g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}"


NUMPY_GLOBALS = _numpy_globals()
_NUMPY_NAMES = frozenset(_name(g) for g in NUMPY_GLOBALS)


def pickled_globals(path: Path, error: BaseException) -> list[str]:
    """The globals a refused file names beyond plain data, without running anything: all of
    them where torch can list them (torch >= 2.5), else the one its refusal names."""
    lister = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if lister is not None:
        try:
            return sorted(lister(str(path)))
        except Exception:  # noqa: BLE001 - not a zip file (the legacy format): read the error
            pass
    found = []
    for m in _REFUSED.finditer(str(error)):
        g = m.group(1) or m.group(2)
        found.append(g if g else f"pickle opcode {m.group(3)}")
    return found[:1] or ["something other than tensors and plain data"]


def _refused(path: Path, error: BaseException, numpy_allowed: bool) -> UnsafeFileError:
    if torch_format(path) is None:  # a plain pickle: no global was even read
        return UnsafeFileError(
            Path(path),
            "refused: it is not a file torch.save wrote (a plain pickle?), the only kind "
            "hybridrec reads; nothing in it was run",
            [],
            convertible=False,
        )
    names = pickled_globals(path, error)
    other = [g for g in names if g not in _NUMPY_NAMES]
    shown = other or names
    what = f"the pickled global{'s' if len(shown) > 1 else ''} {', '.join(shown)}"
    if not other:
        what += f" ({NUMPY_DATA})"
    data = "tensors, numbers, strings, lists and dicts"
    if numpy_allowed:
        data = f"{data} and {NUMPY_DATA}"
    return UnsafeFileError(
        Path(path),
        f"refused: it holds {what}, not only {data}; nothing in it was run",
        other or names,
        convertible=not other,
    )


def torch_format(path: Path) -> str | None:
    """Which torch.save format file `path` is in: "zip" (torch >= 1.6), "legacy" (the older
    pickle-based one, which cannot be memory-mapped), or None (not a torch.save file: a plain
    pickle, text, empty). Reads the first bytes only."""
    with Path(path).open("rb") as f:
        head = f.read(32)
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    return "legacy" if _LEGACY_MAGIC in head else None


def load_tensors(path: Path, mmap: bool = False) -> Any:
    """torch.load(path) as data only (see module doc). UnsafeFileError: one line, the code
    in the file never ran. Other errors (truncated, not a torch.save file) pass through.
    `mmap` maps a zip-format file; a legacy-format one (which torch cannot map) is read
    whole instead."""
    if mmap and torch_format(path) == "legacy":
        mmap = False
    try:
        with warnings.catch_warnings():  # a plain pickle's protocol: refused below anyway
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            return torch.load(Path(path), map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise  # not a refusal: a damaged or foreign file
        raise _refused(Path(path), e, numpy_allowed=False) from None


def load_convertible(path: Path) -> Any:
    """`load_tensors` that also builds numpy arrays, scalars and dtypes (NUMPY_GLOBALS) and
    nothing else: what the checkpoint conversion reads. UnsafeFileError for anything more."""
    try:
        with torch.serialization.safe_globals(NUMPY_GLOBALS):
            return torch.load(Path(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise
        raise _refused(Path(path), e, numpy_allowed=True) from None
