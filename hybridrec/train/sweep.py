"""Multi-rank runs without torchrun, and the summary table of a Hydra sweep.

`python -m hybridrec.main -m sharding=table_wise,row_wise launcher.nproc_per_node=2` runs a
Hydra sweep whose every job is itself a 2-rank run:

- `launch_ranks` (called by main.py when `launcher.nproc_per_node` > 1 and no torchrun is
  around) starts N local ranks with torch elastic, as `torchrun --standalone` would: a c10d
  rendezvous on a free port, one process per rank, each re-running `python -m hybridrec.main`
  with the job's own overrides and `hydra.run.dir` pinned to the job's output directory. So
  every rank of a job shares that directory (metrics.jsonl, W&B, checkpoints), each job has its
  own, and the ranks, which see torchrun's environment, never launch again. It works the same
  outside a sweep: `launcher.nproc_per_node=2 sharding=row_wise` is a 2-rank run on a laptop.
- `SweepSummary`, a Hydra callback (conf/train.yaml, `hydra.callbacks`), writes
  `<job dir>/job.json` after each job (overrides, status, error, wall time) and at the end of
  the sweep prints one row per job (overrides, final loss, the task's headline metric at
  the last val evaluation: AUC, RMSE, or HR@K and NDCG@K; samples/s, status) and
  writes it to `<sweep dir>/summary.md` and `summary.json`. The table is built from the job
  directories, so it also works with launchers that run jobs in other processes, and it is
  printed at exit when a failed job makes Hydra stop before `on_multirun_end`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hybridrec.train.exits import PREEMPTED_EXIT, failure_line, first_failure
from hybridrec.train.loggers import read_metrics, row_split

if TYPE_CHECKING:
    from hybridrec.config import Config

log = logging.getLogger("hybridrec")
SHUTDOWN_GRACE_S = 600  # after a stop signal, how long ranks may take to save before a kill

# Hydra overrides that belong to the sweep (or the parent's own run dir), not to one run.
_PARENT_ONLY = (
    "hydra.run.",
    "hydra.sweep.",
    "hydra.mode",
    "hydra.output_subdir",
    "hydra.sweeper",
    "hydra/sweeper",
    "hydra.launcher",
    "hydra/launcher",
    "hydra.job.num",
    "hydra.job.id",
)
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding hybridrec/
_SWEPT_KEYS_ENV = "HYBRIDREC_SWEPT_KEYS"  # the keys a sweep varies, for its jobs' W&B names


# -- launching ranks -------------------------------------------------------------------------


def _quote(value: str) -> str:
    """A Hydra override value that stays one literal string (paths with spaces, '=', ',')."""
    return "'" + value.replace("'", "\\'") + "'"


def rank_argv(run_dir: Path) -> list[str]:
    """`python` arguments that re-run this Hydra job as one rank writing into `run_dir`.

    The job's config source and name, its task overrides and its own Hydra overrides are passed
    on; the sweep's settings are not. `hydra.output_subdir=null`: the job already saved
    .hydra/ there, and N ranks should not rewrite it.
    """
    hc = HydraConfig.get()
    argv = ["-m", "hybridrec.main"]
    for src in hc.runtime.config_sources:
        path = src.path if src.schema == "file" else f"{src.schema}://{src.path}"
        if src.provider == "main":
            argv.append(f"--config-path={path}")
        elif src.provider == "command-line":
            argv.append(f"--config-dir={path}")
    argv.append(f"--config-name={hc.job.config_name}")
    argv += list(hc.overrides.task)
    argv += [
        o
        for o in hc.overrides.hydra
        if not o.lstrip("+~").startswith(_PARENT_ONLY)  # a sweep's own settings stay with it
    ]
    argv += [f"hydra.run.dir={_quote(str(run_dir.resolve()))}", "hydra.output_subdir=null"]
    return argv


@contextmanager
def environ(**values: str | None) -> Iterator[None]:
    """Set (or, with None, unset) environment variables for the duration of a block."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def wandb_environ() -> dict[str, str | None]:
    """In a sweep, a W&B group per sweep and a run name per job (unless the user set them):
    the job's values of the swept keys (SweepSummary notes them), e.g. `sharding=row_wise`."""
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return {}
    swept = os.environ.get(_SWEPT_KEYS_ENV, "").split(",")
    name = ",".join(o for o in hc.overrides.task if _key(o) in swept)
    name = name or hc.job.override_dirname or f"job {hc.job.num}"
    return {
        "WANDB_RUN_GROUP": os.environ.get("WANDB_RUN_GROUP") or str(hc.sweep.dir),
        "WANDB_NAME": os.environ.get("WANDB_NAME") or name,
    }


def rank_environ() -> dict[str, str | None]:
    """Environment for the ranks this process launches: they import the same hybridrec as
    this process (PYTHONPATH), get one OpenMP thread each unless told otherwise (as torchrun
    does), and the sweep's W&B names."""
    path = os.environ.get("PYTHONPATH")
    return {
        "PYTHONPATH": str(_PACKAGE_ROOT) + (os.pathsep + path if path else ""),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **wandb_environ(),
    }


def check_launch(cfg: Config) -> None:
    """Errors every rank would hit, raised once here before any rank starts."""
    n = cfg.launcher.nproc_per_node
    if cfg.sharding.type == "none":
        raise ValueError(
            f"launcher.nproc_per_node={n} starts {n} ranks, but sharding=none keeps every "
            "table in one process; choose sharding=table_wise|column_wise|row_wise|"
            "data_parallel|auto"
        )
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.device == "cuda" and not gpus:
        raise ValueError("device=cuda but CUDA is not available here; use device=cpu or auto")
    if (cfg.device == "cuda" or (cfg.device == "auto" and gpus)) and n > gpus:
        raise ValueError(
            f"launcher.nproc_per_node={n} but {gpus} GPUs are visible, and NCCL ranks cannot "
            f"share a GPU; use launcher.nproc_per_node<={gpus} or device=cpu (gloo)"
        )


def launch_ranks(cfg: Config, run_dir: Path) -> None:
    """Run this job as `launcher.nproc_per_node` local ranks and wait for them.

    Raises ValueError for a run that cannot start (`check_launch`) and RanksFailed with the
    rank whose failure caused the others (a rank killed without a word before the rank that
    noticed: exits.failure_line), its message and the exit code to end with (every rank's
    output is above and in `<run dir>/ranks/`). SIGTERM, SIGINT and SIGUSR1 to this process
    reach the ranks, which save a checkpoint (with checkpoint.dir) and stop; they get
    `SHUTDOWN_GRACE_S` to do so before they are killed.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    check_launch(cfg)
    launcher = cfg.launcher
    n = launcher.nproc_per_node
    logs = run_dir / "ranks"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=n,
        run_id=f"hybridrec-{uuid.uuid4().hex[:12]}",
        role="rank",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # the c10d store picks a free port itself: no race
        rdzv_configs={"timeout": int(launcher.rdzv_timeout_s)},
        max_restarts=launcher.max_restarts,
        monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=str(logs), tee=Std.ALL),
        signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        shutdown_timeout=SHUTDOWN_GRACE_S,
    )
    argv = rank_argv(run_dir)
    log.info("launching %d ranks: %s %s", n, sys.executable, " ".join(argv))
    try:
        with environ(**rank_environ()):
            elastic_launch(config, sys.executable)(*argv)
    except ChildFailedError as e:
        if {f.exitcode for f in e.failures.values()} == {PREEMPTED_EXIT}:
            message = first_failure(e.failures)[1]
            raise RanksFailed(message or "the ranks saved and stopped", PREEMPTED_EXIT) from None
        raise RanksFailed(*failure_line(e.failures, n, logs)) from None
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        if cfg.checkpoint.dir:
            raise RanksFailed(
                f"{name} received: the ranks saved a checkpoint at their next logging step and "
                "stopped; run the same command again to resume",
                PREEMPTED_EXIT,
            ) from None
        raise RanksFailed(
            f"{name} received: the ranks stopped without saving (no checkpoint.dir)",
            128 + int(e.sigval),
        ) from None


class RanksFailed(RuntimeError):
    """A multi-rank run ended early: `exitcode` is what the launching process exits with."""

    def __init__(self, message: str, exitcode: int) -> None:
        super().__init__(message)
        self.exitcode = exitcode


def final_metrics(metrics_path: Path) -> dict[str, Any]:
    """From a metrics.jsonl: the last train loss, the median train samples/s, and the task's
    headline metrics at the last evaluation of the val split (a run that evaluated only
    test: of test), `split` naming it: AUC (binary), RMSE (regression), HR@K and NDCG@K at
    the smallest K logged (retrieval; `topk` is that K); None where not logged."""
    rows = read_metrics(metrics_path) if metrics_path.is_file() else []
    train = [r for r in rows if r.get("split") == "train"]
    rates = [r["samples_per_sec"] for r in train if r.get("samples_per_sec") is not None]
    out: dict[str, Any] = {"loss": train[-1].get("loss") if train else None}
    evals = [r for r in rows if row_split(r) == "val"]
    evals = evals or [r for r in rows if row_split(r) == "test"]
    last = evals[-1] if evals else {}
    out["split"] = row_split(last) if last else None
    for key in ("auc", "rmse"):
        out[key] = last.get(key)
    ks = sorted(int(k[3:]) for k in last if k.startswith("hr@") and k[3:].isdigit())
    out["topk"] = ks[0] if ks else None
    out["hr"] = last.get(f"hr@{ks[0]}") if ks else None
    out["ndcg"] = last.get(f"ndcg@{ks[0]}") if ks else None
    out["samples_per_sec"] = statistics.median(rates) if rates else None
    return out


def objective(metrics: dict[str, Any]) -> float | None:
    """What a run returns to a Hydra sweeper: its final val AUC (binary, higher is better),
    RMSE (regression, lower is better) or HR@K at the smallest K (retrieval, higher is
    better); None without an evaluation. `metrics`: final_metrics' dict, or an evaluation's
    metrics as the trainer returns them."""
    for key in ("auc", "rmse", "hr"):
        if metrics.get(key) is not None:
            return float(metrics[key])
    ks = sorted(int(k[3:]) for k in metrics if k.startswith("hr@") and k[3:].isdigit())
    return float(metrics[f"hr@{ks[0]}"]) if ks else None


# -- sweep summary ---------------------------------------------------------------------------


def _is_multirun(config: DictConfig) -> bool:
    return OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN


class SweepSummary(Callback):
    """Hydra callback: job.json per job, summary.md/json and a printed table per sweep."""

    def __init__(self) -> None:
        self._sweep_dir: Path | None = None
        self._job_start = 0.0
        self._done = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._sweep_dir = Path(str(config.hydra.sweep.dir))
        parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
        swept = [o.key_or_group for o in parsed if o.is_sweep_override()]
        os.environ[_SWEPT_KEYS_ENV] = ",".join(swept)
        atexit.register(self._finish)  # a failed job ends the sweep before on_multirun_end

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish()

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._job_start = time.time()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not _is_multirun(config):
            return
        error = None
        if job_return.status == JobStatus.FAILED:
            try:
                job_return.return_value  # noqa: B018 - re-raises the job's exception
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"
        record = {
            "job": int(config.hydra.job.num),
            "overrides": list(job_return.overrides or []),
            "status": job_return.status.name.lower(),
            "error": error,
            "wall_s": round(time.time() - self._job_start, 2) if self._job_start else None,
        }
        out = Path(str(config.hydra.runtime.output_dir))
        out.mkdir(parents=True, exist_ok=True)
        (out / "job.json").write_text(json.dumps(record, indent=1) + "\n")

    def _finish(self) -> None:
        if self._done or self._sweep_dir is None:
            return
        self._done = True
        summary = write_summary(self._sweep_dir)
        if summary is not None:
            print(summary, flush=True)


def job_records(sweep_dir: Path) -> list[dict[str, Any]]:
    """One record per job directory of a sweep (those with job.json or .hydra/): its job.json
    (job, overrides, status, error, wall_s) and `dir`, in job order."""
    jobs = []
    for d in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        info_path, overrides_path = d / "job.json", d / ".hydra" / "overrides.yaml"
        info = None
        if info_path.is_file():
            try:
                info = json.loads(info_path.read_text())
            except json.JSONDecodeError:
                log.warning("%s is not a job record; using the job's Hydra overrides", info_path)
        if info is None and overrides_path.is_file():  # the job died before Hydra reported it
            overrides = OmegaConf.to_container(OmegaConf.load(overrides_path))
            info = {"job": None, "overrides": overrides, "status": "unknown", "error": None}
        if info is not None:
            jobs.append({**info, "dir": d.name})
    jobs.sort(key=lambda j: (j.get("job") is None, j.get("job") or 0, j["dir"]))
    return jobs


def collect_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """`job_records` with each job's final metrics."""
    return [
        {**j, **final_metrics(sweep_dir / j["dir"] / "metrics.jsonl")}
        for j in job_records(sweep_dir)
    ]


def common_overrides(jobs: list[dict[str, Any]]) -> list[str]:
    """The overrides every job of a sweep shares (none for a single job: its own are what
    describe it); the rest tell the jobs apart."""
    if len(jobs) < 2:
        return []
    return [o for o in jobs[0]["overrides"] if all(o in j["overrides"] for j in jobs)]


def _fmt(value: Any, digits: int) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, (int, float)) else str(value)


def summary_markdown(jobs: list[dict[str, Any]], common: list[str]) -> str:
    """The sweep's table: a job per row, its final loss and its task's headline metrics at
    the last val evaluation (final_metrics): AUC always, RMSE when a job is a regression,
    HR@K and NDCG@K when one is a retrieval run."""
    rmse = any(j.get("rmse") is not None for j in jobs)  # regression runs: their RMSE too
    ks = sorted({j["topk"] for j in jobs if j.get("topk") is not None})  # retrieval runs
    top = f"@{ks[0]}" if len(ks) == 1 else "@K"
    header = "| job | overrides | status | final loss | final AUC |"
    header += " final RMSE |" * rmse + f" final HR{top} | final NDCG{top} |" * bool(ks)
    header += " samples/s | wall s |"
    lines = [header, "|---" * (7 + rmse + 2 * bool(ks)) + "|"]
    for j in jobs:
        varying = [o for o in j["overrides"] if o not in common] or ["(none)"]
        status = j["status"] + (f": {j['error']}" if j.get("error") else "")
        status = status.replace("|", "/").replace("\n", " ")[:200]
        cells = [
            _fmt(j["job"], 0),
            " ".join(varying),
            status,
            _fmt(j["loss"], 5),
            _fmt(j["auc"], 4),
            *([_fmt(j.get("rmse"), 4)] if rmse else []),
            *([_topk(j, "hr", ks), _topk(j, "ndcg", ks)] if ks else []),
            _fmt(j["samples_per_sec"], 0),
            _fmt(j.get("wall_s"), 1),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if common:
        lines += ["", "every job: " + " ".join(common)]
    return "\n".join(lines)


def _topk(job: dict[str, Any], key: str, ks: list[int]) -> str:
    """A retrieval job's HR or NDCG cell, its K named when jobs differ in K."""
    cell = _fmt(job.get(key), 4)
    return f"{cell} (@{job['topk']})" if len(ks) > 1 and job.get(key) is not None else cell


def write_summary(sweep_dir: Path) -> str | None:
    """Write <sweep dir>/summary.md and summary.json; return the Markdown (None: no jobs)."""
    if not sweep_dir.is_dir():
        return None
    jobs = collect_jobs(sweep_dir)
    if not jobs:
        return None
    common = common_overrides(jobs)
    table = summary_markdown(jobs, common)
    (sweep_dir / "summary.md").write_text(f"# Sweep {sweep_dir}\n\n{table}\n")
    payload = {"sweep_dir": str(sweep_dir.resolve()), "common_overrides": common, "jobs": jobs}
    (sweep_dir / "summary.json").write_text(json.dumps(payload, indent=1) + "\n")
    return f"\nSweep summary ({sweep_dir / 'summary.md'}):\n{table}\n"
