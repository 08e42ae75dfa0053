"""Reading files as data only: a file never runs code when hybridrec loads it.

`load_tensors` is torch.load with `weights_only=True`: tensors, numbers, strings, None,
lists, tuples and dicts come back; anything else a pickle can hold (a callable such as
os.system, an object of an unknown class, a numpy array) is refused before it is built,
with one line naming the file and the global or opcode that was refused. Checkpoints,
exports and warm-start files go through it; their callers add what to do next.

Dataset files are read with `np.load(..., allow_pickle=False)` at each call site (object
arrays are refused there, naming the file).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

_REASONS = (
    (re.compile(r"GLOBAL ([\w.]+)"), "the pickled global {}"),
    (re.compile(r"Unsupported operand (\d+)"), "pickle opcode {}"),
)


class UnsafeFileError(ValueError):
    """A file holding more than data (a pickled callable, an unknown global): refused.
    `reason` is the message without the path, for callers that name the file their way."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def refusal_reason(error: BaseException) -> str:
    """What torch's weights-only unpickler refused, in a few words (its message is long)."""
    text = str(error)
    for pattern, template in _REASONS:
        m = pattern.search(text)
        if m:
            return template.format(m.group(1))
    return "something other than tensors and plain data"


def load_tensors(path: Path, mmap: bool = False) -> Any:
    """torch.load(path) as data only (see module doc). UnsafeFileError: one line, the code
    in the file never ran. Other errors (truncated, not a torch.save file) pass through."""
    try:
        return torch.load(Path(path), map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise  # not a refusal: a damaged or foreign file
        raise UnsafeFileError(
            Path(path),
            f"refused: it holds {refusal_reason(e)}, not only tensors, numbers, strings, "
            "lists and dicts; nothing in it was run",
        ) from None
