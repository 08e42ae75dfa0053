"""docs/configuration.md's key table is the schema's: every key, its default and its meaning."""

from __future__ import annotations

import runpy
from pathlib import Path

from omegaconf import OmegaConf

from hybridrec.config import Config

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = runpy.run_path(str(ROOT / "scripts" / "config_reference.py"))


def _leaves(node: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in node.items():
        nested = isinstance(v, dict) and v  # an empty dict (model.args) is one key
        out += _leaves(v, f"{prefix}{k}.") if nested else [f"{prefix}{k}"]
    return out


def test_the_doc_lists_every_schema_key_with_its_default():
    _, table, _ = REFERENCE["_split"]((ROOT / "docs" / "configuration.md").read_text())
    assert table == REFERENCE["table"](), "run: python scripts/config_reference.py"
    keys = [row.split("`")[1] for row in table.splitlines()[2:]]
    assert keys == _leaves(OmegaConf.to_container(OmegaConf.structured(Config())))


def test_every_key_has_a_meaning():
    blank = [r.split("`")[1] for r in REFERENCE["rows"]() if r.endswith("|  |")]
    assert not blank, f"schema fields without a comment: {blank}"
