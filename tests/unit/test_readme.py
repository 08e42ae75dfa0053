"""The README's promises about itself: short enough to read (<= 14 KB), and exactly two
commands for a fresh machine, each a script that exists and runs scripts/setup.sh first."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def test_readme_is_at_most_14_kb():
    size = len(README.read_bytes())
    assert size <= 14 * 1024, f"README.md is {size} bytes; keep it <= 14,336 (details go to docs/)"


def test_quick_start_has_exactly_two_commands_that_set_up_first():
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in quick.strip().splitlines()]
    assert commands == ["bash scripts/train.sh", "bash scripts/test.sh"], commands
    for cmd in commands:
        script = REPO / cmd.split()[1]
        assert script.is_file(), f"{cmd}: {script} is missing"
        body = script.read_text()
        assert re.search(r"scripts/setup\.sh", body), f"{script.name} does not run setup.sh"
