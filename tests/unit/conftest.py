"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def exact_sqrt(monkeypatch):
    """torch's Tensor.sqrt, correctly rounded (fp32 via fp64: exact for sqrt): torch's CPU
    sqrt is 1 ulp off for a few inputs, the native and Triton kernels' is not."""
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda t: torch.sqrt(t.double()).to(t.dtype))
