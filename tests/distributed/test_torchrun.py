"""The equivalence rule through the real CLI: torchrun with N ranks logs the same per-step
losses as one process with sharding=none (same seed, steps and global batch), and all ranks
of a torchrun job share one run directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
COMMON = [
    "train.steps=6",
    "train.log_every=1",
    "train.batch_size=96",
    "eval.batches=1",
    "eval.batch_size=96",
    "seed=3",
    "device=cpu",
    "optim.sparse.name=adam",
    "optim.sparse.lr=0.01",
]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["split"] == "train"]


def _torchrun(
    n: int, args: list[str], cwd: Path, restarts: int = 0, **env: str
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={n}",
        f"--max-restarts={restarts}",
        "-m",
        "hybridrec.main",
        *args,
    ]
    return subprocess.run(
        cmd, cwd=cwd, env={**_env(), **env}, capture_output=True, text=True, timeout=300
    )


def test_torchrun_losses_equal_single_process(tmp_path):
    ref = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridrec.main",
            "sharding=none",
            *COMMON,
            f"hydra.run.dir={tmp_path / 'ref'}",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, ref.stderr
    for n, mode in [(2, "row_wise"), (3, "auto")]:
        out = _torchrun(
            n, [f"sharding={mode}", *COMMON, f"hydra.run.dir={tmp_path / mode}"], tmp_path
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert "sharding plan" in out.stderr
        got, want = _losses(tmp_path / mode), _losses(tmp_path / "ref")
        assert len(got) == len(want) == 6
        for g, w in zip(got, want):
            assert abs(g - w) <= 1e-5 + 1e-4 * abs(w), (mode, got, want)


def test_torchrun_ranks_share_one_default_run_dir(tmp_path):
    out = _torchrun(2, ["sharding=table_wise", "train.steps=2", "eval.batches=1"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [p.parent for p in (tmp_path / "outputs").rglob("metrics.jsonl")]
    hydra_dirs = [p.parent for p in (tmp_path / "outputs").rglob(".hydra")]
    assert len(runs) == 1 and hydra_dirs == runs, (runs, hydra_dirs)
    # --standalone's rendezvous id is a random uuid: the run is named by date and time
    assert re.fullmatch(
        r"\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}", str(runs[0].relative_to(tmp_path / "outputs"))
    )


def test_killed_rank_restarts_and_resumes_to_the_same_weights(tmp_path):
    """torchrun --max-restarts=1, checkpoints every 3 steps, rank 1 SIGKILLed at step 7: the
    job restarts, resumes from step 6 and ends with the uninterrupted run's weights."""
    import torch

    from hybridrec.train.checkpoint import export_checkpoint

    args = [
        "sharding=column_wise",
        "train.steps=10",
        "train.log_every=1",
        "eval.batches=1",
        "checkpoint.every=3",
        "checkpoint.keep=5",
        *COMMON[2:],
    ]
    clean = _torchrun(
        2,
        [*args, f"checkpoint.dir={tmp_path / 'clean'}", f"hydra.run.dir={tmp_path / 'clean_run'}"],
        tmp_path,
    )
    assert clean.returncode == 0, clean.stderr[:3000]
    crash = _torchrun(
        2,
        [*args, f"checkpoint.dir={tmp_path / 'crash'}", f"hydra.run.dir={tmp_path / 'crash_run'}"],
        tmp_path,
        restarts=1,
        HYBRIDREC_FAULT="1:7",
    )
    assert crash.returncode == 0, crash.stderr[-3000:]
    assert "fault injection at step 7" in crash.stderr
    assert "resumed from" in crash.stderr and "step_6 at step 6" in crash.stderr
    a = export_checkpoint(tmp_path / "clean" / "step_10", tmp_path / "a.pt")
    export_checkpoint(tmp_path / "crash" / "step_10", tmp_path / "b.pt")
    wa, wb = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    for name in a:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-6, atol=1e-7)
    losses = _losses(tmp_path / "crash_run")
    assert [round(x, 6) for x in losses] == [round(x, 6) for x in _losses(tmp_path / "clean_run")]
