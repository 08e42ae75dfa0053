"""The open-world audit's data section: data, config and day by day (docs/data-spec.md,
docs/dynamic.md "Day by day"), through the CLIs in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.audit.cases import Case, _outcome
from tests.cli import REPO, run_cli


# -- data, config, day by day (docs/data-spec.md, docs/dynamic.md "Day by day") -------------
def data_cases() -> list[Case]:
    """Issue 41's data and config cases and the day-by-day recipe, through the CLIs
    (hybridrec-preprocess, hybridrec-train, hybridrec-export) at the audit's scale: a label
    of 1e39, a 3 MB CSV line, tables.rows != capacity, optim.sparse.weight_decay=nan, an empty
    val split with dynamic tables, logQ with a dynamic item table, the recipe's commands
    (3 days of examples/dynamic's stream, 20,000 rows a day), the unknown rate at eval batch
    2048 against one batch holding the whole split, and a resume on statistics of its own.
    The same checks in the suite, cheaply: tests/data/test_table_nonfinite.py (label beyond
    float32), tests/data/test_table_long_lines.py, tests/data/test_dynamic_spec.py (rows !=
    capacity), tests/unit/test_config.py and tests/train/test_cli_exits.py (nan and inf in
    every float key), tests/retrieval/test_dynamic_item_table.py, tests/train/test_day_by_day.py
    (the recipe as written, count_from, --stats-from, unknown rate, empty val split)."""
    state: dict[str, Path] = {}

    def days(work: Path) -> Path:
        """work/days with spec.yaml and day_1/, day_2/ (20,000 rows each), made once."""
        if "days" not in state:
            import runpy

            import yaml

            from tests.train.test_day_by_day import SPEC

            out = work / "days"
            make = runpy.run_path(str(REPO / "examples" / "dynamic" / "make_stream.py"))["main"]
            make([str(out / "gen"), "--days", "3", "--rows-per-day", "20000", "--users", "4000"])
            for d in (1, 2):
                (out / f"day_{d}").mkdir(parents=True)
                src = out / "gen" / "stream" / f"day={d}" / "part-0.parquet"
                (out / f"day_{d}" / "part-0.parquet").write_bytes(src.read_bytes())
            spec = dict(SPEC, sparse=[dict(s, capacity=4096) for s in SPEC["sparse"]])
            (out / "spec.yaml").write_text(yaml.safe_dump(spec))
            state["days"] = out
        return state["days"]

    def prepared(work: Path, name: str, day: int, *more: str) -> Path:
        out = days(work) / name
        if not out.exists():
            proc = _preprocess(days(work) / "spec.yaml", days(work) / f"day_{day}", out, *more)
            if proc.returncode:
                raise RuntimeError(f"preprocessing {name} failed: {proc.stderr[-2000:]}")
        return out

    def label_beyond_float32(work: Path) -> str | None:
        src = work / "label.csv"
        rows = [f"{i % 5 + 1}.0,u{i % 7}" for i in range(100)]
        rows[41] = "1e39,u1"
        src.write_text("score,user\n" + "\n".join(rows) + "\n")
        spec = _spec(work / "label.yaml", {"column": "score", "task": "regression"})
        proc = _preprocess(spec, src, work / "label_bin")
        return _outcome(
            proc, 1, f"hybridrec-preprocess: error: label column 'score' holds 1e+39 at {src} "
            "row 42, which is not finite in float32",
        )  # fmt: skip

    def long_csv_line(work: Path) -> str | None:
        src = work / "long.csv"
        tags = "|".join(f"t{j}" for j in range(400_000))  # one line of 3 MB
        rows = [f"{i % 2},u{i % 7},a|b" for i in range(5000)]
        rows[2500] = f"1,u1,{tags}"
        src.write_text("clicked,user,tags\n" + "\n".join(rows) + "\n")
        spec = _spec(
            work / "long.yaml",
            {"column": "clicked"},
            extra=[{"name": "tags", "column": "tags", "kind": "list", "max_len": 4}],
        )
        proc = _preprocess(spec, src, work / "long_bin")
        if proc.returncode != 0 or "reading with 4 MiB blocks" not in proc.stderr:
            return f"exit {proc.returncode}; stderr {proc.stderr.strip()[-400:]!r}"
        from hybridrec.data.dataset import open_dataset

        n = open_dataset(work / "long_bin").num_rows
        return None if n == 5000 else f"{n} rows written, not 5000"

    def rows_not_capacity(work: Path) -> str | None:
        spec = _spec(work / "cap.yaml", {"column": "clicked"}, encoding="dynamic", table_rows=100)
        src = work / "cap.csv"
        src.write_text("clicked,user\n" + "\n".join(f"{i % 2},{i}" for i in range(50)) + "\n")
        proc = _preprocess(spec, src, work / "cap_bin")
        return _outcome(
            proc, 2, f"hybridrec-preprocess: error: {spec}: tables[0] (user).rows=100 differs "
            "from sparse[0] (user).capacity=64",
        )  # fmt: skip

    def nan_setting(work: Path) -> str | None:
        proc = run_cli("optim.sparse.weight_decay=nan", cwd=work)
        return _outcome(
            proc, 2, "hybridrec-train: optim.sparse.weight_decay must be a finite number, got nan"
        )

    def empty_val_split(work: Path) -> str | None:
        import yaml

        spec = yaml.safe_load((days(work) / "spec.yaml").read_text())
        spec["split"] = {"by": "rows", "train_fraction": 1.0}
        (work / "noval.yaml").write_text(yaml.safe_dump(spec))
        proc = _preprocess(work / "noval.yaml", days(work) / "day_1", work / "noval_bin")
        if proc.returncode:
            return f"preprocessing failed: {proc.stderr[-400:]!r}"
        proc = _train(work, work / "noval_bin", "train.steps=20", "eval.every=10")
        if proc.returncode == 0 and "eval split 'val' is empty" in proc.stderr:
            return None
        return f"exit {proc.returncode}; stderr {proc.stderr.strip()[-400:]!r}"

    def retrieval_dynamic_logq(work: Path) -> str | None:
        from tests.retrieval.tables import (
            ITEMS,
            TWO_TOWER,
            USERS,
            interactions,
            spec,
            write_dataset,
        )

        s = spec(USERS, ITEMS)
        s["sparse"][1] = {
            "name": "item_id", "column": "item_id", "encoding": "dynamic", "capacity": 64
        }  # fmt: skip
        data = write_dataset(work / "retrieval", interactions(), s)
        proc = run_cli(
            "data=table", f"data.path={data}", "train.batch_size=16", "eval.batch_size=7",
            "device=cpu", "train.steps=4", f"hydra.run.dir={work / 'runs' / 'retrieval'}",
            *TWO_TOWER, cwd=work,
        )  # fmt: skip
        return _outcome(
            proc,
            1,
            "hybridrec-train: train.retrieval.logq=true corrects each item row's logit",
            "set train.retrieval.logq=false",
        )

    def recipe(work: Path) -> str | None:
        from hybridrec.data.dataset import open_dataset
        from hybridrec.train.checkpoint.format import list_checkpoints
        from tests.train.test_day_by_day import SMALL, _recipe, _rows

        root = work / "recipe"
        root.mkdir()
        for name in ("day_1", "day_2", "spec.yaml"):
            src = days(work) / name
            if src.is_dir():
                (root / name).mkdir()
                for f in src.iterdir():
                    (root / name / f.name).write_bytes(f.read_bytes())
            else:
                (root / name).write_bytes(src.read_bytes())
        n, logs = None, []
        for i, argv in enumerate(_recipe()):
            argv = [a.replace("step_N", f"step_{n}") for a in argv]
            if argv[0] == "hybridrec-train":
                proc = run_cli(*argv[1:], *SMALL, f"hydra.run.dir={root / f'run_{i}'}", cwd=root)
                logs.append((root / f"run_{i}", proc.stderr))
                if n is None and proc.returncode == 0:
                    n = int(list_checkpoints(root / "ckpt" / "run")[-1].name.split("_")[1])
            else:
                module = {"hybridrec-preprocess": "hybridrec.data.preprocess_cli"}.get(
                    argv[0], "hybridrec.train.export_cli"
                )
                proc = _module(module, *argv[1:], cwd=root)
            if proc.returncode:
                return f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr[-400:]!r}"
        m = open_dataset(root / "day_2_bin").manifest
        per_epoch = (m.splits["train"][1] - m.splits["train"][0]) // 256
        (_, _), (day2, log2), (warm, _) = logs
        steps2 = [r["step"] for r in _rows(day2) if r["split"] == "train"]
        warm_steps = [r["step"] for r in _rows(warm) if r["split"] == "train"]
        if steps2 != list(range(n + 1, n + per_epoch + 1)):
            return f"day 2 trained steps {steps2[:2]}..{steps2[-1:]}, not {n + 1}..{n + per_epoch}"
        if warm_steps[-1] != per_epoch:
            return f"the warm start trained {warm_steps[-1]} steps, not {per_epoch} (one pass)"
        if "standardized with other statistics" in log2:
            return "day 2 (--stats-from day_1_bin) warned of other statistics"
        return None

    def unknown_rate_at_2048(work: Path) -> str | None:
        data = prepared(work, "day_1_bin", 1)
        ck = work / "unknown_ck"
        proc = _train(work, data, "train.epochs=1", f"checkpoint.dir={ck}")
        if proc.returncode:
            return f"training failed: {proc.stderr[-400:]!r}"
        from hybridrec.data.dataset import open_dataset

        lo, hi = open_dataset(data).manifest.splits["val"]
        rates = {}
        for batch in (2048, hi - lo):  # 2048: a wrapped last batch; hi - lo: one exact batch
            run = work / f"unknown_eval_{batch}"
            proc = _train(work, data, "eval.only=true", "eval.batches=null",
                          f"eval.batch_size={batch}", f"checkpoint.dir={ck}",
                          f"hydra.run.dir={run}")  # fmt: skip
            if proc.returncode:
                return f"eval.only failed: {proc.stderr[-400:]!r}"
            (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            rates[batch] = row["dynamic/user/unknown_rate"]
        if rates[2048] != rates[hi - lo]:
            return f"unknown_rate {rates[2048]} at batch 2048, {rates[hi - lo]} exact"
        return None

    def own_statistics_warn(work: Path) -> str | None:
        day1 = prepared(work, "day_1_bin", 1)
        own = prepared(work, "day_2_own_bin", 2)
        ck = work / "stats_ck"
        proc = _train(work, day1, "train.epochs=1", f"checkpoint.dir={ck}")
        if proc.returncode:
            return f"training failed: {proc.stderr[-400:]!r}"
        proc = _train(
            work, own, "train.epochs=1", "train.count_from=resume", f"checkpoint.dir={ck}"
        )
        want = "is standardized with other statistics than the checkpoint's training data (x0 mean"
        if proc.returncode == 0 and want in proc.stderr and f"--stats-from {day1}" in proc.stderr:
            return None
        return f"exit {proc.returncode}; no warning naming x0 and --stats-from {day1}"

    return [
        Case(
            "a regression label of 1e39 in a CSV (float32 inf once stored)",
            label_beyond_float32,
            "exit 1, one line naming the file, row and that it is not finite in float32",
        ),
        Case(
            "a CSV line of 3 MB with --spec (pyarrow's 1 MiB blocks)",
            long_csv_line,
            "exit 0: read with larger blocks (logged), every row written",
        ),
        Case(
            "spec tables[].rows=100 for a dynamic table of capacity 64",
            rows_not_capacity,
            "exit 2, one line naming tables[0].rows and sparse[0].capacity",
        ),
        Case(
            "optim.sparse.weight_decay=nan",
            nan_setting,
            "exit 2, one line (as =-1)",
        ),
        Case(
            "an empty val split with dynamic tables",
            empty_val_split,
            "exit 0, the empty split warned about (as hashing tables)",
        ),
        Case(
            "retrieval with a dynamic item table and train.retrieval.logq=true",
            retrieval_dynamic_logq,
            "exit 1, one line: raw ids have no per-row counts; set train.retrieval.logq=false",
        ),
        Case(
            "docs/dynamic.md's day-by-day commands, as written",
            recipe,
            "day 2 resumed: one pass (N+1..N+M); the warm start: one pass; no statistics warning",
        ),
        Case(
            "unknown_rate at eval.batch_size=2048 against one batch of the whole val split",
            unknown_rate_at_2048,
            "the same rate (the wrapped rows of the last batch not counted)",
        ),
        Case(
            "resume on day 2 standardized with its own statistics",
            own_statistics_warn,
            "a warning naming x0's means and --stats-from <day 1's dataset>",
        ),
    ]


def _module(module: str, *args: str, cwd: Path):  # noqa: ANN202
    """`python -m module *args` in `cwd` with this checkout importable."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def _preprocess(spec: Path, src: Path, out: Path, *more: str):  # noqa: ANN202
    return _module(
        "hybridrec.data.preprocess_cli", "--spec", str(spec), "--input", str(src), "--output",
        str(out), *more, cwd=out.parent,
    )  # fmt: skip


def _spec(
    path: Path,
    label: dict,
    encoding: str = "vocabulary",
    table_rows: int | None = None,
    extra: list[dict] | None = None,
) -> Path:
    import yaml

    user = {"name": "user", "column": "user", "encoding": encoding}
    if encoding == "dynamic":
        user["capacity"] = 64
    tables = [{"name": "user", "width": 4, **({"rows": table_rows} if table_rows else {})}]
    tables += [{"name": e["name"], "width": 4} for e in extra or []]
    spec = {
        "label": label,
        "sparse": [user, *(extra or [])],
        "tables": tables,
        "split": {"by": "rows", "train_fraction": 0.8},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def _train(work: Path, data: Path, *more: str):  # noqa: ANN202
    runs = len(list(work.glob("runs/*")))
    return run_cli(
        "data=table", f"data.path={data}", "train.batch_size=256", "eval.batch_size=512",
        "device=cpu", f"hydra.run.dir={work / 'runs' / str(runs)}", *more, cwd=work,
    )  # fmt: skip
