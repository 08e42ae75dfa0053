"""benchmarks/gpu_suite.sh and its library probe, checked without a GPU: GPU time is short,
so a wrong flag, a missing section or a probe that does not run must fail here first.

`DRY_RUN=1` prints each section's commands and limits instead of running them; the probe
(tests/gpu/library_model.py) runs on the CPU at a tiny size, where it compares the CPU with
itself and must find no difference at all (host caches change when rows move, never what
they hold).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.gpu import library_model

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"


def _suite(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(tmp_path / "out"), "DRY_RUN": "1", "CARD": "h200", **env}
    return subprocess.run(
        ["bash", str(SUITE), *args], capture_output=True, text=True, env=full, timeout=120
    )


def test_the_scripts_parse():
    for script in (SUITE, ROOT / "scripts" / "gpu_wheels.sh"):
        run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr


def test_all_runs_every_section_in_order_into_at_most_8_files(tmp_path):
    run = _suite(tmp_path, "all")
    assert run.returncode == 0, run.stdout + run.stderr
    starts = [line.split(":")[0][3:] for line in run.stdout.splitlines() if line.startswith("== ")]
    assert starts == ["env", "tests", "probe", "step", "host-kaggle", "host-1tb", "suite"]
    for command in (
        "+ nvidia-smi",
        "python3 -m pytest tests/gpu tests/unit/test_triton_training.py",
        "python3 -m tests.gpu.library_model --device cuda",
        f"python3 -m benchmarks.step --device cuda --model dlrm_kaggle --batch-size 65536 "
        f"--kernels triton --out {tmp_path / 'out' / 'step_h200.md'}",
        "--model dlrm_kaggle --batch-size 65536 --cache-fraction 0.05 --warmup 300 "
        "--optimizers sgd --naive-steps 0",
        "--model dlrm_1tb --batch-size 65536 --cache-gb 12 --hbm-gb 16 --warmup 400 --steps 60",
    ):
        assert command in run.stdout, command
    files = sorted(p.relative_to(tmp_path / "out") for p in (tmp_path / "out").rglob("*"))
    assert len(files) <= 8 and all(len(f.parts) == 1 for f in files), files
    summary = (tmp_path / "out" / "suite.log").read_text()
    assert "host-1tb: exit 0" in summary and "-> host.log" in summary


def test_a_section_gets_no_more_than_the_time_left(tmp_path):
    """SUITE_S bounds the whole run: a section never takes what those after it need at least
    (240 s from probe on); one that cannot have its own least is skipped, saying so."""
    run = _suite(tmp_path, "all", SUITE_S="400")
    assert run.returncode == 0
    # the clock runs during a dry run too: on a loaded machine `env` can take a second or two
    assert 155 <= _seconds(r"== tests: limit (\d+)s", run.stdout) <= 160, run.stdout
    assert "== host-1tb: limit 200s" in run.stdout
    run = _suite(tmp_path, "all", SUITE_S="330")
    assert run.returncode == 1
    left = _seconds(r"tests: skipped, (\d+)s left for it \(needs 100s\)", run.stdout)
    assert 85 <= left <= 90, run.stdout
    assert "== probe: limit 90s" in run.stdout and "host-1tb: exit 0" in run.stdout


def _seconds(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    assert found, (pattern, text)
    return int(found.group(1))


def test_one_section_and_an_unknown_one(tmp_path):
    run = _suite(tmp_path, "host-1tb", "--steps", "10")
    assert run.returncode == 0
    assert "--optimizers sgd" not in run.stdout and run.stdout.rstrip().endswith("--steps 10")
    assert (tmp_path / "out" / "host-1tb.log").exists()
    run = _suite(tmp_path, "nothing")
    assert run.returncode == 2 and run.stdout.startswith("gpu_suite: unknown section 'nothing'")


def test_the_library_probe_runs_on_the_cpu_and_finds_no_difference(capsys):
    args = ["--device=cpu", "--steps=2", "--batch-size=64", "--optimizers=sgd,adagrad"]
    assert library_model.main([*args, "--adagrad-eps=1e-3"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[-5]) for r in rows] == [
        ("sgd", "none"),
        ("sgd", "host"),
        ("adagrad", "none"),
        ("adagrad", "host"),
    ]
    assert all(r[-4] == r[-3] == "0.00e+00" for r in rows), rows
