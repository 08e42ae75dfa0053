"""benchmarks/torchrec_step.py compares like with like: TorchRec's embedding gradients are scaled
by 1/W once (TorchRec's own output dist does it; the benchmark adds nothing), the systems'
losses must agree within 1e-6 over the first 10 steps or the run stops, and the systems' steps
alternate in order. The parts without TorchRec run everywhere; the 2-rank parity run needs
TorchRec and fbgemm-gpu-cpu (the benchmark's docstring says how to make that venv) and skips
without them.
"""

from __future__ import annotations

import math

import pytest

from benchmarks import paired, torchrec_step


def _has_torchrec() -> bool:
    return torchrec_step._torchrec_available() is None


def test_steps_alternate_their_order():
    systems = ["hybridrec", "torchrec", "torchrec_ebc"]
    orders = [paired.step_order(systems, i) for i in range(4)]
    assert orders[0] == orders[2] == systems
    assert orders[1] == orders[3] == list(reversed(systems))
    firsts = [o[0] for o in orders]
    assert firsts.count("hybridrec") == firsts.count("torchrec_ebc") == 2  # each leads as often


def test_ratios_are_paired_per_step():
    """A burst of load that slows both sides of one step leaves the paired ratio alone."""
    ours = [10.0, 10.0, 30.0, 10.0, 10.0]
    theirs = [12.0, 12.0, 36.0, 12.0, 12.0]
    assert paired.paired_ratio(theirs, ours) == pytest.approx((1.2, 1.2, 1.2))
    assert paired.slowest([[1.0, 5.0], [2.0, 3.0]]) == [2.0, 5.0]


def test_parity_names_a_gap_above_1e_6_and_passes_round_off():
    """3e-6 within 10 steps is what TorchRec trained on half its gradient showed at 2 ranks
    (the double 1/W scaling); 1e-7 is float32 round-off."""
    ours = [0.69 - 0.01 * i for i in range(12)]
    halved = [x + (3e-6 if i == 4 else 0.0) for i, x in enumerate(ours)]
    late = [x + (5e-6 if i == 11 else 1e-7) for i, x in enumerate(ours)]  # past step 10
    per_rank = [
        {"hybridrec": ours, "torchrec": halved, "torchrec_ebc": late},
        {"hybridrec": ours, "torchrec": ours, "torchrec_ebc": ours},
    ]
    gaps = paired.loss_gaps(per_rank, "hybridrec", paired.PARITY_STEPS)
    assert gaps["torchrec"] == (pytest.approx(3e-6, rel=1e-3), 4)
    assert gaps["torchrec_ebc"][0] == pytest.approx(1e-7, rel=1e-2)
    failures = paired.parity_failures("W=2 row_wise", gaps, torchrec_step.NAMES, "hybridrec")
    assert len(failures) == 1
    assert failures[0].startswith("parity failed: W=2 row_wise, TorchRec DLRM: its loss differs")
    assert "3.0e-06 at step 4" in failures[0]
    whole = paired.loss_gaps(per_rank, "hybridrec", None)
    assert whole["torchrec_ebc"] == (pytest.approx(5e-6, rel=1e-3), 11)
    nan = [{"hybridrec": ours, "torchrec": [math.nan] * 12}]
    assert paired.parity_failures(
        "x", paired.loss_gaps(nan, "hybridrec", 10), {"torchrec": "t"}, "hybridrec"
    )


def test_runs_that_cannot_compare_are_refused(capsys):
    with pytest.raises(SystemExit):
        torchrec_step.parse_args(["--steps", "3", "--warmup", "2"])
    assert "--warmup + --steps must be at least 10" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # TorchRec's column shards keep row statistics apart
        torchrec_step.parse_args(["--optimizer", "rowwise_adagrad"])
    assert "pass --modes table_wise,row_wise" in capsys.readouterr().err


@pytest.mark.skipif(_has_torchrec(), reason="TorchRec is installed here")
def test_without_torchrec_it_says_how_to_get_it(capsys):
    assert torchrec_step.main(["--world-sizes", "1"]) == 2
    assert "TorchRec is not importable here" in capsys.readouterr().err


@pytest.mark.skipif(not _has_torchrec(), reason="needs torchrec and fbgemm-gpu-cpu")
def test_torchrec_is_not_scaled_twice():
    from torchrec.distributed.comm_ops import get_gradient_division, set_gradient_division

    assert get_gradient_division()  # TorchRec's default: its output dist divides by W
    assert torchrec_step.torchrec_scale(1) is None and torchrec_step.torchrec_scale(2) is None
    set_gradient_division(False)
    try:
        assert torchrec_step.torchrec_scale(2) == 0.5  # then the 1/W is ours to add
    finally:
        set_gradient_division(True)


@pytest.mark.slow
@pytest.mark.skipif(not _has_torchrec(), reason="needs torchrec and fbgemm-gpu-cpu")
@pytest.mark.parametrize(
    "optimizer, modes",
    [("sgd", "table_wise,row_wise,column_wise"), ("rowwise_adagrad", "table_wise,row_wise")],
)
def test_two_ranks_train_the_same_model_in_every_mode(tmp_path, capsys, optimizer, modes):
    """At 2 ranks, TorchRec's DLRM and its EBC under our dense part lose within 1e-6 of
    hybridrec over 10 steps in every mode (the benchmark exits 1 otherwise)."""
    out = tmp_path / "report.md"
    args = ["--world-sizes", "2", "--model", "dlrm_tiny", "--batch-size", "256"]
    args += ["--steps", "2", "--warmup", "8", "--optimizer", optimizer, "--modes", modes]
    assert torchrec_step.main([*args, "--out", str(out)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    for mode in modes.split(","):
        assert f"W=2 {mode}: loss gap to hybridrec, first 10 / all steps: TorchRec DLRM" in printed
    text = out.read_text()
    assert "Load average (1, 5, 15 min) before:" in text and "Machine: " in text
    assert "Parity: every loss gap to hybridrec within the first 10 steps" in text
