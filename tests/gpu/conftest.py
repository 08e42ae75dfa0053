"""GPU tests: run on a CUDA machine (the device tool's H100), skipped everywhere else."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
