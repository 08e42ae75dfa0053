"""The benchmarks a GPU session runs (benchmarks/gpu_suite.sh) work end to end, on the CPU.

A device call is 10 minutes of scarce GPU time: a benchmark that fails on an argument, an
import or its report must fail here first. Tiny sizes; only that each script runs and writes
the rows of its report is checked (speed is never a test).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import cache_policy, lookup_update, step

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_step_benchmark_writes_rows_and_the_time_breakdown(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDREC_KERNELS", "torch")  # Triton's interpreter would be slow
    out = tmp_path / "step.md"
    step.main(
        [
            "--device=cpu",
            "--model=dlrm_tiny",
            "--batch-size=256",
            "--steps=2",
            "--warmup=1",
            "--optimizers=sgd,adam",
            "--plain-adam",
            "--per-table-layout",
            "--fp32-handoff",
            f"--out={out}",
        ]
    )
    text = out.read_text()
    rows = (
        "plain PyTorch, EmbeddingBag + SGD",
        "+ SparseAdam",
        "dense part alone",
        "hybridrec, adam",
        "hybridrec, sgd, per-table layout",
        "hybridrec, sgd, fp32 pooled hand-off",
    )
    for row in rows:
        assert row in text
    assert "## Where the time goes" in text and "sparse update" in text


def test_lookup_update_benchmark_writes_every_phase(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDREC_KERNELS", "torch")
    out = tmp_path / "lookup.md"
    lookup_update.main(
        ["--device=cpu", "--rows=20000", "--tables=4", "--batch-size=512", "--dim=16"]
        + ["--steps=2", "--warmup=1", "--optimizer=all", f"--out={out}"]
    )
    text = out.read_text()
    for phase in ("lookup", "dedupe", "update", "total"):
        assert f"| {phase}" in text


def test_cache_policy_replay_reports_warm_and_cold(tmp_path):
    out = tmp_path / "policy.md"
    cache_policy.main(
        ["--model=dlrm_tiny", "--batch-size=512", "--cache-fraction=0.05", "--steps=2"]
        + ["--warmup=2", "--start=warm,cold", "--evict-share=0.015625,0.25", "--halflife=7"]
        + [f"--out={out}"]
    )
    text = out.read_text()
    assert "| warm " in text and "| cold " in text and "best static" in text
    assert "| evict share |" in text and "| 0.25 " in text and "| 0.01562 " in text
    assert "| halflife |" in text and "| 7 " in text


def test_host_cache_benchmark_runs_every_row(tmp_path):
    out = tmp_path / "host.md"
    env = {**os.environ, "HYBRIDREC_KERNELS": "torch", "PYTHONPATH": str(ROOT)}
    args = ["--device=cpu", "--model=dlrm_tiny", "--batch-size=256", "--steps=2"]
    args += ["--warmup=3", "--naive-steps=2", "--optimizers=sgd", "--inline-prefetch"]
    args += [f"--out={out}"]
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_cache", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    text = out.read_text()
    rows = ["all on cpu, sgd", "host + cache, sgd", "prefetch on the main thread"]
    for row in [*rows, "naive CPU EmbeddingBag"]:
        assert row in text
    assert "a new synthetic batch every step" in text and "warm-started" in text
    assert "| pipelined ms/step |" in text  # training's way (no wait between steps) too


def test_preprocess_table_benchmark_writes_both_formats(tmp_path):
    from benchmarks import preprocess_table

    out = tmp_path / "prep.md"
    preprocess_table.main(["--rows=3000", "--repeat=1", "--batch-rows=1000", f"--out={out}"])
    text = out.read_text()
    assert "| parquet " in text and "| csv " in text and "preprocess / bare read" in text
    assert "Architecture:" in text or "(lscpu not available)" in text


def test_sparse_update_benchmark_reports_every_path_and_shape(tmp_path):
    from benchmarks import sparse_update

    out = tmp_path / "sparse_update.md"
    sparse_update.main(
        ["--optimizer=all", "--sizes=500,6000", "--batch-size=3000", "--steps=2", "--warmup=1"]
        + ["--repeats=1", f"--out={out}"]
    )
    text = out.read_text()
    for shape in ("one", "rowwise2"):
        for name in ("sgd", "rowwise_adagrad", "adam", "adagrad"):
            assert f"| {shape}" in text and f"| {name}" in text
    assert "| former / hybridrec |" in text and "| plain / hybridrec |" in text
    assert "Load average (1, 5, 15 min) before:" in text and "- Git: " in text


def test_huge_pages_benchmark_compares_both_kinds_of_pages(tmp_path):
    from benchmarks import huge_pages

    out = tmp_path / "pages.md"
    args = ["--sizes=300000,400000", "--batch-size=512", "--steps=2", "--batches=2"]
    rc = huge_pages.main([*args, "--evict-mb=1", f"--out={out}"])
    if rc == 2:
        pytest.skip("transparent huge pages or the C kernels are not available here")
    text = out.read_text()
    for phase in ("lookup", "dedupe", "sgd update", "all three"):
        assert f"| {phase} " in text
    assert "transparent huge pages: " in text and "- Git: " in text


def test_commits_pairs_two_copies_of_one_checkout(tmp_path):
    """The same code on both sides: every loss equal, the batches equal, a ratio near 1."""
    from benchmarks import commits

    out = tmp_path / "paired.md"
    args = ["--base", str(ROOT), "--new", str(ROOT), "--sharding-modes=table_wise"]
    args += ["--sharding-worlds=1", "--sharding-args=--model dlrm_tiny --batch-size 256"]
    args += ["--dynamic=", "--steps=4", "--warmup=1", f"--out={out}"]
    assert commits.main(args) == 0
    text = out.read_text()
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("| benchmark"))

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip("|").split("|")]

    row = dict(zip(cells(lines[head]), cells(lines[head + 2]), strict=True))
    assert (row["benchmark"], row["variant"], row["W"]) == ("sharding_gloo", "table_wise", "1")
    assert row["largest loss gap"] == "0 (exact)" and row["checks"] == "ok"
    # a few steps of a small model on a shared machine: a preempted step can take several
    # times as long, so only gross errors (units, sides swapped into nonsense) are caught
    for name in ("new/base (median)", "CPU new/base (median)"):
        assert 0.1 < float(row[name].strip("*")) < 10.0, (name, row)
    assert "Machine: " in text and "Host load during the run: " in text and "```bash" in text


def test_commits_checks_out_a_commit_as_a_worktree_and_removes_it(tmp_path):
    from benchmarks import commits

    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    co = commits.checkout("HEAD", tmp_path, "base")
    try:
        assert co.worktree and (co.path / "hybridrec" / "train" / "trainer.py").is_file()
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True, capture_output=True
        ).stdout.strip()
        assert co.label.startswith(head)
    finally:
        commits.remove(co)
    assert not co.path.exists()
    with pytest.raises(SystemExit, match="--new no-such-ref: neither a directory nor a commit"):
        commits.checkout("no-such-ref", tmp_path, "new")


def test_commits_loss_gap_sees_any_difference():
    from benchmarks.commits import loss_gap

    same = [[0.5, 0.25], [0.75, 0.125]]
    assert loss_gap(same, [list(r) for r in same]) == (0.0, 0.0)
    gap, rel = loss_gap(same, [[0.5, 0.25], [0.75, 0.125 + 1e-6]])
    assert gap == pytest.approx(1e-6) and rel == pytest.approx(8e-6)
    assert loss_gap(same, [[0.5, float("nan")], [0.75, 0.125]]) == (float("inf"), float("inf"))
    assert loss_gap([[0.0]], [[1e-9]])[1] == float("inf")


def _user_item_file(path: Path, users: int = 40, items: int = 30) -> Path:
    """A tiny `user item` file (1-based ids, a user's lines contiguous): 4..14 events each."""
    g = torch.Generator().manual_seed(0)
    lines = []
    for u in range(1, users + 1):
        n = 4 + int(torch.randint(0, 11, (1,), generator=g))
        lines += [f"{u} {int(i) + 1}" for i in torch.randint(0, items, (n,), generator=g)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sasrec_step_benchmark_keeps_parity_and_writes_every_row(tmp_path, capsys):
    """hybridrec's SASRec step and plain PyTorch's (SparseAdam: to 1e-6 over 10 steps; dense
    Adam: at the first step) train the same model on the same batches, or the run exits 1."""
    from benchmarks import sasrec_step

    data, out = _user_item_file(tmp_path / "games.txt"), tmp_path / "sasrec.md"
    args = ["--max-len=8", "--dim=8", "--batch-size=16", "--steps=2", "--warmup=8"]
    rc = sasrec_step.main([f"--data={data}", *args, f"--out={out}"])
    assert rc == 0, capsys.readouterr().err
    text = out.read_text()
    for name in sasrec_step.NAMES.values():
        assert f"| {name} " in text
    assert "Load average (1, 5, 15 min) before:" in text and "- Git: " in text


def _has_torchrec() -> bool:
    from benchmarks import torchrec_step

    return torchrec_step._torchrec_available() is None


@pytest.mark.skipif(not _has_torchrec(), reason="needs torchrec and fbgemm-gpu-cpu")
def test_sequence_torchrec_benchmark_keeps_parity_in_every_mode(tmp_path, capsys):
    """At 1 and 2 ranks (table- and row-wise) TorchRec's EmbeddingCollection under the same
    dense part loses within 1e-6 of hybridrec's sequence features over 10 steps, or the
    run exits 1 and writes nothing."""
    from benchmarks import sequence_torchrec

    out = tmp_path / "sequence.md"
    args = ["--world-sizes=1,2", "--items=500", "--categories=20", "--length=8", "--dim=8"]
    args += ["--batch-size=64", "--steps=2", "--warmup=8", f"--out={out}"]
    assert sequence_torchrec.main(args) == 0, capsys.readouterr().err
    text = out.read_text()
    for row in ("| 1 | one process ", "| 2 | table_wise ", "| 2 | row_wise "):
        assert row in text
    assert "Parity: every loss gap to hybridrec within the first 10 steps" in text


@pytest.mark.skipif(_has_torchrec(), reason="TorchRec is installed here")
def test_sequence_torchrec_without_torchrec_says_how_to_get_it(capsys):
    from benchmarks import sequence_torchrec

    assert sequence_torchrec.main(["--world-sizes=1"]) == 2
    assert "TorchRec is not importable here" in capsys.readouterr().err


def test_exact_cost_pairs_the_modes_and_checks_exact_parity_across_world_sizes(tmp_path):
    """dlrm_tiny at W=1 and 2, a few steps: a row per W with both modes' times and a ratio,
    the memory rows, and exact mode's losses equal across W (else the run exits 1)."""
    from benchmarks import exact_cost

    out = tmp_path / "exact.md"
    args = ["--models=dlrm_tiny", "--batch-size=64", "--steps=2", "--warmup=1"]
    assert exact_cost.main([*args, "--memory-steps=1", f"--out={out}"]) == 0
    text = out.read_text()
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("| model "))

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip("|").split("|")]

    for w, line in zip((1, 2), lines[head + 2 : head + 4], strict=True):
        row = dict(zip(cells(lines[head]), cells(line), strict=True))
        assert (row["model"], row["W"]) == ("dlrm_tiny", str(w))
        assert 0.1 < float(row["CPU exact/default (IQR)"].split()[0]) < 100.0, row
        assert float(row["largest rel. loss gap default vs exact"].split()[0]) < 1e-4, row
    mem = [cells(ln)[1:3] for ln in lines if ln.startswith("| dlrm_tiny") and ln.count("|") == 7]
    assert mem == [["1", "default"], ["1", "exact"], ["2", "default"], ["2", "exact"]]
    assert "- dlrm_tiny: exact mode's 3 losses at W=2 equal W=1's, bit for bit" in text
    assert "Machine: " in text and "```bash" in text
