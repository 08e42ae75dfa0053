"""W&B integration: offline by default, online only with credentials, never fatal, and what
it logs is what metrics.jsonl holds (read back from the offline run file, see wandb_file.py).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybridrec.train.loggers import WandbLogger, wandb_logged_in, wandb_mode
from tests.train.wandb_file import history, offline_run_file, read_records, run_record

REPO = Path(__file__).resolve().parents[2]
_WANDB_ENV = (
    "WANDB_MODE",
    "WANDB_API_KEY",
    "WANDB_IDENTITY_TOKEN_FILE",
    "WANDB_BASE_URL",
    "WANDB_DISABLED",
    "WANDB_NAME",
    "WANDB_RUN_GROUP",
)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _WANDB_ENV}
    env.update(
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        HOME=str(tmp_path),  # no ~/.netrc: not logged in
        WANDB_DIR=str(tmp_path / "wandb_dir"),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb_data"),
        WANDB_SILENT="true",
    )
    env.update(extra)
    return env


def _train_offline(tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess:
    """`hybridrec-train <args>` in a subprocess with W&B offline; it must succeed."""
    out = subprocess.run(
        [sys.executable, "-m", "hybridrec.main", *args],
        cwd=tmp_path,
        env=_env(tmp_path, WANDB_MODE="offline"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


# -- mode selection (no wandb import, no network) -----------------------------------------------


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No W&B variables, and a home directory without ~/.netrc."""
    for k in (*_WANDB_ENV, "NETRC"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return monkeypatch


def test_auto_mode_is_offline_without_credentials(clean_env):
    assert not wandb_logged_in()
    assert wandb_mode("auto") == "offline"


def test_auto_mode_is_online_with_an_api_key(clean_env):
    clean_env.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("auto") == "online"


def test_auto_mode_is_online_with_a_netrc_entry(clean_env, tmp_path):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.org login user password secret\n")
    netrc.chmod(0o600)
    clean_env.setenv("NETRC", str(netrc))
    assert wandb_mode("auto") == "offline"  # a netrc, but not for W&B
    netrc.write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    assert wandb_mode("auto") == "online"
    clean_env.setenv("WANDB_BASE_URL", "https://wandb.mycompany.com")
    assert wandb_mode("auto") == "offline"  # logged in to another server


def test_environment_and_explicit_modes(clean_env, caplog):
    clean_env.setenv("WANDB_API_KEY", "x" * 40)
    clean_env.setenv("WANDB_MODE", "offline")
    assert wandb_mode("auto") == "offline"  # WANDB_MODE beats credentials
    assert wandb_mode("online") == "online"  # an explicit logger.mode beats WANDB_MODE
    clean_env.setenv("WANDB_MODE", "dryrun")
    assert wandb_mode("auto") == "offline"
    clean_env.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") == "disabled"
    clean_env.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ValueError, match="WANDB_MODE='sometimes' is not one of"):
        wandb_mode("auto")
    clean_env.delenv("WANDB_API_KEY")
    clean_env.setenv("WANDB_MODE", "online")
    with caplog.at_level(logging.WARNING, logger="hybridrec"):
        assert wandb_mode("auto") == "offline"  # online without a key would prompt and wait
    assert "no credentials" in caplog.text


def test_a_failing_wandb_init_is_only_a_warning(clean_env, tmp_path, caplog):
    wandb = pytest.importorskip("wandb")

    def boom(**kwargs):
        raise RuntimeError("network is unreachable")

    clean_env.setattr(wandb, "init", boom)
    with caplog.at_level(logging.WARNING, logger="hybridrec"):
        logger = WandbLogger(tmp_path / "run", "hybridrec", "offline", {"seed": 0})
    assert logger.run is None
    assert "continuing with metrics.jsonl only" in caplog.text
    assert "network is unreachable" in caplog.text
    logger.log({"step": 1, "split": "train", "loss": 0.5})  # no-ops, no errors
    logger.log_table("plan", ["table"], [["cat_0"]])
    logger.close()


# -- real offline runs (subprocesses: wandb keeps global state and a service process) ----------


@pytest.mark.slow
def test_offline_run_logs_what_metrics_jsonl_holds(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "logger=wandb",
        "logger.tags=[test]",
        "sharding=table_wise",  # one rank, but through the planner: the plan is logged too
        "train.steps=12",
        "train.log_every=3",
        "train.batch_size=64",
        "eval.every=6",
        "eval.batches=1",
        "eval.batch_size=256",
        "device=cpu",
        f"hydra.run.dir={run_dir}",
    ]
    out = _train_offline(tmp_path, args)
    assert "(offline)" in out.stderr and "wandb sync" in out.stderr

    rows = _jsonl(run_dir / "metrics.jsonl")
    records = read_records(offline_run_file(run_dir))
    logged = history(records)
    by_step: dict[int, dict[str, Any]] = {}
    for row in logged:
        by_step.setdefault(row["_step"], {}).update(row)

    train = [r for r in rows if r["split"] == "train"]
    evals = [r for r in rows if r["split"] == "val"]
    assert [r["step"] for r in train] == [3, 6, 9, 12] and [r["step"] for r in evals] == [6, 12]
    for r in train:  # every key of every row, prefixed by its split
        for key, value in r.items():
            if key not in ("step", "split") and value is not None:
                assert by_step[r["step"]][f"train/{key}"] == pytest.approx(value, rel=1e-12), key
    for r in evals:
        assert by_step[r["step"]]["val/auc"] == pytest.approx(r["auc"], rel=1e-12)
        assert by_step[r["step"]]["val/logloss"] == pytest.approx(r["logloss"], rel=1e-12)
    # and no metric rows W&B has that metrics.jsonl does not (tables may sit at other steps)
    metric_steps = {
        s for s, r in by_step.items() if any(k.split("/")[0] in ("train", "val") for k in r)
    }
    assert metric_steps == {r["step"] for r in rows}

    plan = next(r for r in logged if "sharding_plan.nrows" in r)
    assert plan["sharding_plan._type"] == "table-file" and plan["sharding_plan.nrows"] == 6

    run = run_record(records)
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["train"]["steps"] == 12 and config["logger"]["name"] == "wandb"
    assert config["launcher"]["nproc_per_node"] == 1
    assert list(run.tags) == ["test"] and run.display_name == run_dir.name


@pytest.mark.slow
def test_tables_and_an_unreachable_server(tmp_path):
    """log_table writes a wandb.Table; online mode against a server that refuses connections
    gives up after WANDB_INIT_TIMEOUT with a warning, and logging goes on without W&B."""
    script = """
import logging, sys
from pathlib import Path
from hybridrec.train.loggers import WandbLogger
logging.basicConfig(level=logging.INFO)
w = WandbLogger(Path(sys.argv[1]), "hybridrec", "auto", {"seed": 0})
print("RUN", w.mode, w.run is not None)
w.log({"step": 5, "split": "train", "loss": 0.25})
w.log_table("sharding_plan", ["table", "ranks"], [["cat_0", "0"], ["cat_1", "0,1"]])
w.close()
"""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-c", script, str(run_dir)],
        cwd=tmp_path,
        env=_env(tmp_path, WANDB_MODE="offline"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "RUN offline True" in out.stdout, out.stderr[-3000:]
    rows = history(read_records(offline_run_file(run_dir)))
    step5 = {k: v for r in rows if r["_step"] == 5 for k, v in r.items()}
    assert step5["train/loss"] == 0.25
    assert step5["sharding_plan._type"] == "table-file" and step5["sharding_plan.nrows"] == 2
    table_file = run_dir.glob("wandb/offline-run-*/files/" + step5["sharding_plan.path"])
    table = json.loads(next(table_file).read_text())
    assert table["columns"] == ["table", "ranks"]
    assert table["data"] == [["cat_0", "0"], ["cat_1", "0,1"]]

    env = _env(
        tmp_path,
        WANDB_API_KEY="x" * 40,  # "logged in" ...
        WANDB_BASE_URL="http://127.0.0.1:9",  # ... to a server that refuses connections
        WANDB_INIT_TIMEOUT="2",
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "online")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RUN online False" in out.stdout
    assert "could not start, continuing with metrics.jsonl only" in out.stderr


@pytest.mark.slow
def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    """The checkpoint keeps the W&B run id: the resumed job (a new run dir here, as after a
    resubmitted preempted job) logs into the same W&B run, not a new one."""
    ck = tmp_path / "ck"
    ids = []
    for steps, name in ((6, "first"), (9, "second")):
        run_dir = tmp_path / name
        args = [
            "logger=wandb",
            f"train.steps={steps}",
            "train.log_every=3",
            "eval.every=0",
            "eval.batches=1",
            "train.batch_size=64",
            "eval.batch_size=64",
            "device=cpu",
            f"checkpoint.dir={ck}",
            "checkpoint.every=3",
            f"hydra.run.dir={run_dir}",
        ]
        out = _train_offline(tmp_path, args)
        ids.append(run_record(read_records(offline_run_file(run_dir))).run_id)
    assert "continued from the checkpoint" in out.stderr
    assert ids[0] and ids[0] == ids[1]
