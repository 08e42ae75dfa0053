"""Weight decay of a row update, the same on every backend (hybridrec.kernels.rows).

`decay_of(opt, weight_decay)` -> Decay: what one update applies, from the optimizer's
`weight_decay_mode` and its `weight_decay` or the caller's (one value for all rows, or [U]
per row: a fused group whose tables have decays of their own). Before the optimizer's maths,
in fp32 on the row's stored values w, each product and sum rounded once as torch's separate
ops (the C and Triton kernels do the same operations):
- L2:        g <- g + (w * wd)           (`l2_grads`) the maths, a row-wise statistic included,
                                          see this g: torch.optim's weight_decay, FBGEMM's L2
- DECOUPLED: w <- w * (1 - (lr * wd))    (`decayed_rows`) then the maths' step (AdamW; FBGEMM's
                                          DECOUPLE); lr: the optimizer's `lr`, not Adam's
                                          bias-corrected step
A decay of 0 for every row is NO_DECAY: the undecayed kernels, the same bits as without.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridrec.types import WEIGHT_DECAY_MODES

WeightDecay = float | torch.Tensor | None  # an update's weight_decay=: see decay_of

NO_DECAY, L2, DECOUPLED = 0, 1, 2  # Decay.kind (the kernels' DECAY constexpr)


@dataclass(frozen=True)
class Decay:
    """The weight decay of one update: `kind` NO_DECAY, L2 or DECOUPLED (module docstring);
    `value` the decay of every row, or `rows` [U] fp32 each row's own (then `value` is
    unused); `lr` the learning rate decoupled decay scales by."""

    kind: int = NO_DECAY
    value: float = 0.0
    rows: torch.Tensor | None = None
    lr: float = 0.0

    def factor(self, like: torch.Tensor) -> torch.Tensor:
        """wd as an fp32 tensor that broadcasts over [U, D] rows like `like`: [U, 1] or []."""
        if self.rows is not None:
            return self.rows.to(device=like.device, dtype=torch.float32).unsqueeze(1)
        return torch.tensor(self.value, dtype=torch.float32, device=like.device)

    def cut(self, n: int) -> Decay:
        """The decay of the first n rows (padded inputs cut to their real rows)."""
        return self if self.rows is None else Decay(self.kind, 0.0, self.rows[:n], self.lr)


def decay_of(opt: Any, weight_decay: WeightDecay = None) -> Decay:
    """The Decay of an update of `opt` given `weight_decay`: None (opt.weight_decay for every
    row), a float (for every row) or a [U] fp32 tensor (one per row, as a fused group holding
    several tables' shards passes). A decay of 0 for every row (a float) is NO_DECAY."""
    wd = opt.weight_decay if weight_decay is None else weight_decay
    if not isinstance(wd, torch.Tensor) and float(wd) == 0.0:
        return Decay()
    mode = opt.weight_decay_mode
    if mode not in WEIGHT_DECAY_MODES:
        raise ValueError(
            f"{opt.name}: weight_decay_mode={mode!r} is not one of: {', '.join(WEIGHT_DECAY_MODES)}"
        )
    kind = L2 if mode == "l2" else DECOUPLED
    lr = float(opt.lr) if kind == DECOUPLED else 0.0
    if isinstance(wd, torch.Tensor):
        return Decay(kind, 0.0, wd, lr)
    return Decay(kind, float(wd), None, lr)


def l2_grads(grads: torch.Tensor, w_rows: torch.Tensor, decay: Decay) -> torch.Tensor:
    """g + (w * wd) for L2 decay (else g): the gradient the maths see; w_rows [U, D] fp32."""
    if decay.kind != L2:
        return grads
    return grads + w_rows * decay.factor(w_rows)


def decayed_rows(w_rows: torch.Tensor, decay: Decay) -> torch.Tensor:
    """w * (1 - (lr * wd)) for decoupled decay (else w), fp32 [U, D]."""
    if decay.kind != DECOUPLED:
        return w_rows
    return w_rows * (1 - decay.factor(w_rows) * decay.lr)
