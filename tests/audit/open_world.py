"""The open-world audit's cases (issue 41) that are too slow for the test suite, as a user
meets them (the CLI in a subprocess): a table of (case, check, expected outcome), run in
order, printed PASS/FAIL per case; exit status 1 if any failed.

    python -m tests.audit.open_world              # every section
    python -m tests.audit.open_world data         # one section (SECTIONS' names: data, dynamic)

Each section is a module with a function returning its Case rows (tests/audit/cases.py); add
one beside the others (and to SECTIONS) rather than editing another's. The cheap cases are
pytest tests, named in each section's docstring.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tests.audit.cases import Case
from tests.audit.data_section import data_cases
from tests.audit.dynamic_section import dynamic_cases

SECTIONS: dict[str, Callable[[], list[Case]]] = {"data": data_cases, "dynamic": dynamic_cases}


def main(argv: list[str]) -> int:
    names = argv or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        print(f"no section {unknown[0]!r}; sections: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    failed = 0
    for section in names:
        with tempfile.TemporaryDirectory(prefix=f"audit_{section}_") as tmp:
            for case in SECTIONS[section]():
                try:
                    seen = case.check(Path(tmp))
                except Exception as e:  # noqa: BLE001 - a case that crashes is a FAIL row
                    seen = f"{type(e).__name__}: {e}"
                failed += seen is not None
                print(f"{'PASS' if seen is None else 'FAIL'}  [{section}] {case.name}")
                print(f"      expected: {case.expected}")
                if seen is not None:
                    print(f"      seen:     {seen}")
    print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
