"""Multi-layer perceptrons, initialised as the reference of the model they belong to.

init="dlrm" (the MLPerf DLRM reference, facebookresearch/dlrm): weights N(0, sqrt(2 / (fan_in +
fan_out))), biases N(0, sqrt(1 / fan_out)). init="torch" (the MLPerf DCNv2 reference: torchrec's
DLRM_DCN builds its MLPs from plain nn.Linear layers and keeps their default init): weights
kaiming_uniform_(a=sqrt(5)), i.e. U(+-1/sqrt(fan_in)), biases U(+-1/sqrt(fan_in)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

MLP_INITS = ("dlrm", "torch")
# a model's initialisation (model.init): its arch's reference, or one MLP init for every arch
MODEL_INITS = ("reference", *MLP_INITS)


class MLP(nn.Sequential):
    """Linear layers of the given output widths with ReLU between them.

    [B, in_features] -> [B, widths[-1]]. `final_relu` also applies ReLU after the last layer
    (DLRM's bottom MLP does, its top MLP ends in a bare logit). `init`: one of MLP_INITS.
    """

    def __init__(
        self, in_features: int, widths: Sequence[int], final_relu: bool, init: str = "dlrm"
    ) -> None:
        if init not in MLP_INITS:
            raise ValueError(f"MLP init {init!r} is not one of: {', '.join(MLP_INITS)}")
        layers: list[nn.Module] = []
        for i, width in enumerate(widths):
            linear = nn.Linear(in_features, width)  # torch's default init
            if init == "dlrm":
                _dlrm_init(linear)
            layers.append(linear)
            if i < len(widths) - 1 or final_relu:
                layers.append(nn.ReLU())
            in_features = width
        super().__init__(*layers)


def _dlrm_init(linear: nn.Linear) -> None:
    """Weights ~ N(0, sqrt(2 / (fan_in + fan_out))), bias ~ N(0, sqrt(1 / fan_out))."""
    fan_out, fan_in = linear.weight.shape
    with torch.no_grad():
        linear.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)))
        linear.bias.normal_(0.0, math.sqrt(1.0 / fan_out))
