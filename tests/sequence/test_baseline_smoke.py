"""benchmarks/sasrec_baseline.py runs end to end on a tiny `user item` file, with either loss,
and writes every figure (speed and accuracy are never tested here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import sasrec_baseline

pytestmark = pytest.mark.slow


def tiny_file(path, users: int = 60, items: int = 150):  # noqa: ANN001, ANN201
    rng = np.random.default_rng(0)
    lines = []
    for u in range(1, users + 1):
        start = int(rng.integers(1, items - 20))
        lines += [f"{u} {start + k}" for k in range(int(rng.integers(3, 12)))]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("loss", ["bce", "softmax"])
def test_baseline_trains_selects_on_val_and_reports_test(tmp_path, loss):
    out = tmp_path / "out.json"
    argv = [
        f"--data={tiny_file(tmp_path / 'seq.txt')}",
        "--max-len=8",
        "--dim=8",
        "--batch=16",
        "--epochs=3",
        "--eval-every=1",
        f"--loss={loss}",
        "--negatives=4" if loss == "softmax" else "--negatives=2",
        f"--out={out}",
    ]
    assert sasrec_baseline.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["best_epoch"] in (1, 2, 3) and result["epochs_run"] == 3
    for split in ("val", "test"):
        for key in ("hr@10", "ndcg@10", "hr@50", "sampled_hr@10", "sampled_ndcg@10"):
            assert 0.0 <= result[split][key] <= 1.0, (split, key)
        assert result[split]["eval_users"] == 60
    assert [row["epoch"] for row in result["history"]] == [1, 2, 3]


def test_the_side_by_side_benchmark_reports_both_and_the_checks(tmp_path):
    """benchmarks/sasrec_games.py: the preset on 2 ranks beside the baseline, one report with
    both sides' val and test rows, the full-catalogue ratio and the issue's three checks."""
    from benchmarks import sasrec_games

    out = tmp_path / "report.md"
    argv = [
        f"--data={tiny_file(tmp_path / 'seq.txt')}", f"--work={tmp_path / 'work'}",
        f"--out={out}", "--set", "train.epochs=null", "train.steps=4", "train.batch_size=8",
        "model.embedding_dim=8", "train.retrieval.negatives=8", "eval.every=2",
        "--baseline", "--max-len=8", "--dim=8", "--batch=16", "--epochs=1", "--eval-every=1",
    ]  # fmt: skip
    assert sasrec_games.main(argv) == 0
    text = out.read_text()
    assert text.count("| test ") == 3  # the baseline's, hybridrec's and the paper's rows
    assert "2 rank(s)" in text and "- Baseline counts" in text
    assert "Test full-catalogue HR@10, hybridrec / baseline:" in text
