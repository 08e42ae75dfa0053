"""docs/configuration.md's key table, generated from hybridrec/config/schema.py.

Every schema key with its default (the dataclass value) and its meaning (the comment beside
the field, after the comment lines just above it). `--check` exits 1 when the table in the doc
differs from the schema (tests/unit/test_config_docs.py runs it); without it, the table in
the doc is rewritten.

    python scripts/config_reference.py [--check]
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import sys
import tokenize
from pathlib import Path
from typing import Any

from hybridrec.config import Config

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "hybridrec" / "config" / "schema.py"
DOC = ROOT / "docs" / "configuration.md"
HEADER = "| key | default | meaning |\n|---|---|---|\n"


def _comments(source: str) -> dict[int, str]:
    """Line number -> text of the comment on that line."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}


def _meanings(source: str) -> dict[tuple[str, str], str]:
    """(class, field) -> the comment lines just above the field, then the one beside it."""
    comments = _comments(source)
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            parts, n = [], item.lineno - 1
            while n in comments and lines[n - 1].lstrip().startswith("#"):
                parts.insert(0, comments[n])
                n -= 1
            parts.append(comments.get(item.end_lineno or item.lineno, ""))
            out[(node.name, item.target.id)] = " ".join(filter(None, parts))
    return out


def _default(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float | int) and not isinstance(value, bool):
        return repr(value)
    return json.dumps(value, separators=(", ", ": "))


def rows(node: Any = None, prefix: str = "", meanings: dict | None = None) -> list[str]:
    """One markdown table row per schema key under `node` (default: the whole Config)."""
    node = Config() if node is None else node
    meanings = _meanings(SCHEMA.read_text()) if meanings is None else meanings
    out = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            out += rows(value, f"{prefix}{f.name}.", meanings)
            continue
        meaning = meanings.get((type(node).__name__, f.name), "").replace("|", "&#124;")
        out.append(f"| `{prefix}{f.name}` | `{_default(value)}` | {meaning} |")
    return out


def table() -> str:
    return HEADER + "\n".join(rows()) + "\n"


def _split(doc: str) -> tuple[str, str, str]:
    """(text before the table, the table, text after it)."""
    start = doc.index(HEADER)
    end = doc.find("\n\n", start)
    end = len(doc) if end < 0 else end + 1
    return doc[:start], doc[start:end], doc[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the doc is out of date")
    args = p.parse_args(argv)
    before, current, after = _split(DOC.read_text())
    if current == table():
        return 0
    if args.check:
        print(f"{DOC.relative_to(ROOT)} is out of date: run python scripts/config_reference.py")
        return 1
    DOC.write_text(before + table() + after)
    print(f"rewrote the key table in {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
