"""Shared test helpers. Multi-process tests live in tests/distributed, GPU ones in tests/gpu."""

from __future__ import annotations

import os
from pathlib import Path

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


@pytest.fixture(scope="session")
def sample_tsv() -> Path:
    """The 200-row Criteo sample (criteo_sample.tsv, not in the repository), named by
    $HYBRIDREC_CRITEO_SAMPLE as a user names it; scripts/test.sh sets it when
    ../shared/data/ holds the file. A test that needs it (or `data=criteo_sample`) takes this
    fixture, and skips without it."""
    from hybridrec.data.source import SAMPLE_ENV, sample_path

    if not os.environ.get(SAMPLE_ENV):
        pytest.skip(
            f"needs the Criteo sample: set ${SAMPLE_ENV} to criteo_sample.tsv (scripts/test.sh "
            "does when ../shared/data/ holds it)"
        )
    return sample_path(None)


@pytest.fixture(scope="session", autouse=True)
def _shared_process_groups():
    """The equivalence suites' process groups (tests/distributed/harness.py run_shared) live
    for the session; each rank exits 0 at its end."""
    yield
    from tests.distributed.harness import close_shared

    close_shared()
