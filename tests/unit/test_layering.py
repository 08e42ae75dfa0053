"""Dependency direction (docs/architecture.md, Layering), checked by reading imports, not by convention."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "hybridrec"


def _imports(path: Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
    return mods


@pytest.mark.parametrize(
    "sub",
    [
        "model",
        "planner",
        "sparse/costs.py",
        "kernels",
        "sparse/fused.py",
        "sparse/collection.py",
        "optim",
        "types.py",
        "config",
        "safeload.py",
    ],
)
def test_never_imports_torch_distributed(sub):
    files = [PKG / sub] if sub.endswith(".py") else sorted((PKG / sub).rglob("*.py"))
    for f in files:
        bad = {m for m in _imports(f) if m.startswith("torch.distributed")}
        assert not bad, f"{f.relative_to(PKG)} imports {bad}"


@pytest.mark.parametrize(
    "sub,forbidden,allowed",
    [
        ("types.py", ("hybridrec.",), ()),
        # what every loader uses to read files as data only stands on torch alone
        ("safeload.py", ("hybridrec.",), ()),
        # the planner sizes what the runtime allocates from the runtime's own byte sizes, and
        # sparse optimizers' state from the kinds hybridrec.types declares
        (
            "planner",
            (
                "hybridrec.sparse",
                "hybridrec.model",
                "hybridrec.train",
                "hybridrec.distributed",
                "hybridrec.optim",
            ),
            ("hybridrec.sparse.costs",),
        ),
        ("sparse/costs.py", ("hybridrec.",), ("hybridrec.types",)),
        (
            "sparse",
            (
                "hybridrec.model",
                "hybridrec.optim",
                "hybridrec.train",
                "hybridrec.builder",
                "hybridrec.shard",
            ),
            (),
        ),
        # a model declares its tables; hybridrec.shard gives them rows, sharded or not
        (
            "model",
            (
                "hybridrec.distributed",
                "hybridrec.sparse",
                "hybridrec.train",
                "hybridrec.builder",
                "hybridrec.shard",
            ),
            (),
        ),
        ("distributed", ("hybridrec.model", "hybridrec.sparse", "hybridrec.train"), ()),
        # preprocessing's spawned workers import only numpy and pyarrow
        (
            "data/preprocess",
            ("torch", "hybridrec.model", "hybridrec.sparse", "hybridrec.train"),
            (),
        ),
        # reading users' tables needs numpy and pyarrow only, like Criteo's preprocessing
        (
            "data/tabular",
            ("torch", "hybridrec.model", "hybridrec.sparse", "hybridrec.train"),
            (),
        ),
        ("data/spec.py", ("torch", "hybridrec."), ()),
        # the host cache's policy: tensor functions, no cache object, copies or threads
        (
            "sparse/host/policy.py",
            ("hybridrec.sparse.host", "hybridrec.kernels.host_copy", "threading", "concurrent"),
            (),
        ),
        # the schema is a leaf (its users import it at run time, it imports none of them);
        # the checks import the components' choice lists
        (
            "config/schema.py",
            (
                "hybridrec.config",
                "hybridrec.data",
                "hybridrec.optim",
                "hybridrec.sparse",
                "hybridrec.train",
                "hybridrec.model",
                "hybridrec.kernels",
            ),
            (),
        ),
        # the kernels serve embedding storage and the row optimizers alike: they import
        # neither, and the optimizers reach the kernels directly, not through hybridrec.sparse
        (
            "kernels",
            ("hybridrec.sparse", "hybridrec.optim", "hybridrec.planner", "hybridrec.train"),
            (),
        ),
        ("optim", ("hybridrec.sparse",), ()),
    ],
)
def test_dependencies_point_one_way(sub, forbidden, allowed):
    target = PKG / sub
    files = [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))
    for f in files:
        for m in _imports(f):
            if m in allowed:
                continue
            assert not m.startswith(forbidden), f"{f.relative_to(PKG)} imports {m}"


def test_every_package_file_is_linted():
    """ruff skips some folder names by default (a package folder named `dist` was never
    linted): every file under hybridrec/ must be in what `ruff check` reads."""
    import subprocess
    import sys

    repo = PKG.parent
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "."],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
    linted = {Path(line).resolve() for line in out.stdout.split()}
    unlinted = sorted(str(f.relative_to(repo)) for f in PKG.rglob("*.py") if f not in linted)
    assert not unlinted, f"ruff does not read: {unlinted}"
