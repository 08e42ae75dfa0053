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
        "scoring.py",
        "inference.py",
        "serving.py",
        "next_item_serving.py",
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
        # the dynamic-table policy's one home: the library, the spec (read without torch) and
        # the config checks all validate a policy with it
        ("dynamic_policy.py", ("hybridrec.", "torch", "numpy", "pyarrow"), ()),
        ("types.py", ("hybridrec.",), ("hybridrec.dynamic_policy",)),
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
                "hybridrec.scoring",
                "hybridrec.inference",
                "hybridrec.optim",
                "hybridrec.train",
                "hybridrec.builder",
                "hybridrec.shard",
            ),
            (),
        ),
        # a model declares its tables; hybridrec.shard gives them rows, sharded or not, and
        # hybridrec.scoring the trainer's storage for scoring (hybridrec.inference): no lookup
        # of its own (not even the dynamic tables' hashes and probes of hybridrec.kernels)
        (
            "model",
            (
                "hybridrec.distributed",
                "hybridrec.kernels",
                "hybridrec.sparse",
                "hybridrec.train",
                "hybridrec.builder",
                "hybridrec.shard",
                "hybridrec.scoring",
                "hybridrec.inference",
            ),
            (),
        ),
        # scoring an export: the model and its storage, in one process, under the trainer
        *[
            (
                sub,
                (
                    "hybridrec.distributed",
                    "hybridrec.train",
                    "hybridrec.builder",
                    "hybridrec.shard",
                    "hybridrec.configure",
                    "hybridrec.main",
                ),
                (),
            )
            for sub in ("scoring.py", "inference.py", "serving.py", "next_item_serving.py")
        ],
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
        ("data/spec.py", ("torch", "hybridrec."), ("hybridrec.dynamic_policy",)),
        # the host cache's policy: tensor functions, no cache object, copies or threads
        (
            "sparse/host/policy.py",
            ("hybridrec.sparse.host", "hybridrec.kernels.host_copy", "threading", "concurrent"),
            (),
        ),
        # the schema is a leaf (its users import it at run time, it imports none of them)
        ("config/schema.py", ("hybridrec.",), ("hybridrec.types",)),
        # the config (schema and checks) is a leaf every layer may read: the components'
        # choice lists reach its checks from above, through hybridrec.configure
        (
            "config",
            ("hybridrec.",),
            (
                "hybridrec.types",
                "hybridrec.dynamic_policy",
                "hybridrec.config.schema",
                "hybridrec.config.checks",
                "hybridrec.config.cli",
                "hybridrec.config.dynamic",
                "hybridrec.config.next_item",
                "hybridrec.config.tasks",
                "hybridrec.config.values",
            ),
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


def test_the_model_package_names_the_scoring_api_without_importing_the_storage():
    """hybridrec.model offers load_export, InferenceModel and PredictInputError as it always
    did, but they live in hybridrec.inference (above the storage, which the model layer never
    imports): named by string in the package's `_ABOVE`, resolved on first use. Importing the
    model package loads no storage module; asking for the names gives hybridrec.inference's."""
    import subprocess
    import sys

    code = (
        "import sys; import hybridrec.model as m\n"
        "loaded = sorted(k for k in sys.modules if k.startswith(('hybridrec.sparse', "
        "'hybridrec.inference', 'hybridrec.scoring')))\n"
        "assert not loaded, loaded\n"
        "import hybridrec.inference as i\n"
        "assert set(m._ABOVE) == {'load_export', 'InferenceModel', 'PredictInputError'}\n"
        "assert all(getattr(m, n) is getattr(i, n) for n in m._ABOVE)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=PKG.parent, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]


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


# -- the import graph -------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """{module: the package modules it imports}, for every module of hybridrec/.

    An import counts wherever its statement is: at module level, inside a function, or under
    `if TYPE_CHECKING:`. A deferred import is still a dependency (deferring only hides a
    circle from Python's import machinery), and a type named in an annotation is one too.
    `from pkg import name` depends on the submodule pkg.name when there is one, else on pkg's
    __init__. The parent packages that importing a submodule initialises are not edges: a
    package's __init__ re-exports its submodules, so counting them would make every such
    package a circle with its own parts.
    """
    files = {_module_name(f): f for f in PKG.rglob("*.py")}

    def known(name: str) -> str | None:  # the module itself, or the package that defines name
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(filter(None, (known(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    target = f"{base}.{a.name}" if f"{base}.{a.name}" in files else known(base)
                    if target:
                        deps.add(target)
        deps.discard(mod)
        graph[mod] = deps
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one
    circle's path through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(_path_through(graph, set(part)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path_through(graph: dict[str, set[str]], part: set[str]) -> list[str]:
    """The shortest circle from the first module of a strongly connected set: a -> ... -> a."""
    start = min(part)
    came_from: dict[str, str] = {}
    queue = [start]
    for v in queue:
        for w in sorted(graph[v] & part):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"{sorted(part)} is not strongly connected")


def test_the_package_has_no_import_circle():
    """hybridrec/'s modules import each other without a circle: module-level and deferred
    imports alike (see _import_graph)."""
    circles = _circles(_import_graph())
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_deferred_circle():
    """The test above can fail: a circle through a function-level import, as the config's
    checks once made with the components they took their choices from."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c", "a"]]
    graph = _import_graph()
    assert "hybridrec.config" in graph["hybridrec.model.registry"]
    graph["hybridrec.config"].add("hybridrec.model.registry")  # the old deferred import
    circle = _circles(graph)
    assert circle and {"hybridrec.config", "hybridrec.model.registry"} <= set(circle[0])


def test_importing_the_planner_loads_no_runtime_module():
    """`import hybridrec.planner` (hybridrec-plan, a script's what-if plan) loads the planner,
    the value types and the runtime's byte sizes (hybridrec.sparse.costs) alone: no exchange,
    kernel or collective, and no module of ours that imports torch.distributed. In a fresh
    interpreter, since this one has imported everything already."""
    import subprocess
    import sys

    code = "import sys, hybridrec.planner; print(*(m for m in sys.modules if m.split('.')[0] == 'hybridrec'))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=PKG.parent, capture_output=True, text=True, check=True
    )
    loaded = set(out.stdout.split())
    assert "hybridrec.planner.plan" in loaded  # (the listing works)
    for runtime in ("sparse.sharded", "kernels.rows", "distributed.comm"):
        assert f"hybridrec.{runtime}" not in loaded, f"import hybridrec.planner loads {runtime}"
    files = {_module_name(f): f for f in PKG.rglob("*.py")}
    collective = sorted(
        m for m in loaded if any(i.startswith("torch.distributed") for i in _imports(files[m]))
    )
    assert not collective, f"import hybridrec.planner loads {collective} (torch.distributed)"
    # the value types (with the dynamic policy they re-export, torch-free) and byte sizes
    light = {"hybridrec", "hybridrec.types", "hybridrec.dynamic_policy", "hybridrec.sparse"}
    light.add("hybridrec.sparse.costs")
    others = sorted(m for m in loaded - light if not m.startswith("hybridrec.planner"))
    assert not others, f"import hybridrec.planner loads {others}"


def test_only_entry_points_use_the_validation_above_the_components():
    """hybridrec.configure imports every component: a module it imports must not import it
    back (the circle test), and no component does; the commands do."""
    users = sorted(m for m, deps in _import_graph().items() if "hybridrec.configure" in deps)
    assert users == ["hybridrec.main", "hybridrec.plan_cli"]


def test_test_modules_never_import_each_other():
    """What tests share lives in plain helper modules (tests/equivalence.py, tests/libmodel.py,
    tests/hostcache.py, ...): a test module importing another would run its tests' module
    code, and tie the two files' fixtures and constants together."""
    tests = PKG.parent / "tests"
    bad = []
    for f in sorted(tests.rglob("test_*.py")):
        for m in _imports(f):
            last = m.rsplit(".", 1)[-1]
            if m.startswith("tests.") and last.startswith("test_"):
                bad.append(f"{f.relative_to(tests)} imports {m}")
    assert not bad, bad
