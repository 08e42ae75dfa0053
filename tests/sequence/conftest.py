"""The Amazon Games file of ../shared/data (not in the repository), for the tests that read it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AMAZON_ENV = "HYBRIDREC_AMAZON_GAMES"


@pytest.fixture(scope="session")
def amazon_games() -> Path:
    """amazon_games.txt: $HYBRIDREC_AMAZON_GAMES, or ../shared/data/ beside the repository;
    the test skips without it."""
    path = Path(os.environ.get(AMAZON_ENV, ROOT.parent / "shared" / "data" / "amazon_games.txt"))
    if not path.is_file():
        pytest.skip(f"needs amazon_games.txt: set ${AMAZON_ENV} or put it in ../shared/data/")
    return path
