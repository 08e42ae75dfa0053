"""Shared test helpers. Multi-process tests live in tests/distributed, GPU ones in tests/gpu."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _one_thread():
    """Deterministic CPU reductions and no oversubscription on the 2-core CI machine."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
