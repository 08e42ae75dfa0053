"""End to end: a table whose `user` id and `followed` user ids share the table `user`,
preprocessed and trained by `hybridrec-train data=table` for 3 steps on one rank: the model
takes its features and their one shared table from the dataset and the loss stays finite."""

from __future__ import annotations

import json
import math

from hybridrec.data.spec import parse_spec
from hybridrec.data.tabular import preprocess_table
from tests.cli import run_cli
from tests.data.tables import SHARED_SPEC, follows, write_parquet, write_spec


def test_cli_trains_on_features_sharing_a_table(tmp_path):
    src = write_parquet(tmp_path / "follows.parquet", follows())
    spec = write_spec(tmp_path / "spec.yaml", SHARED_SPEC)
    preprocess_table(parse_spec(SHARED_SPEC), [src], tmp_path / "bin", block_rows=8)
    run = tmp_path / "run"
    out = run_cli(
        "data=table",
        f"data.path={tmp_path / 'bin'}",
        f"data.spec={spec}",
        "train.steps=3",
        "train.batch_size=8",
        "train.log_every=1",
        "eval.batch_size=8",
        "eval.batches=null",
        "device=cpu",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("split") == "train"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), rows
    evals = [r for r in rows if r.get("split") == "val"]
    assert evals and math.isfinite(evals[-1]["logloss"])
