"""Where metrics go: <run dir>/metrics.jsonl always, the console, and W&B with logger=wandb.

Only rank 0 logs (other ranks get a NullLogger). W&B is an optional extra that must never
cost a run: it is imported lazily, runs offline unless the user is logged in (see
`wandb_mode`), its start-up is bounded by a timeout, and any failure of it becomes a warning
while metrics.jsonl keeps every row.
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("hybridrec")

# Hosts `wandb login` writes to ~/.netrc when WANDB_BASE_URL is unset (the classic API host
# and, from wandb 0.31, the default CoreWeave Forge front end of the same service).
_DEFAULT_WANDB_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")
# WANDB_MODE values wandb accepts, as the mode they mean.
_ENV_MODES = {
    "online": "online",
    "run": "online",
    "offline": "offline",
    "dryrun": "offline",
    "disabled": "disabled",
}
# logger.name: metrics.jsonl only, or also Weights & Biases; logger.mode: how W&B runs
LOGGERS = ("none", "wandb")
WANDB_MODES = ("auto", "offline", "online", "disabled")
INIT_TIMEOUT_S = 30.0  # wandb.init gives up after this long (env WANDB_INIT_TIMEOUT overrides)
FINISH_TIMEOUT_S = 60.0  # online: stop uploading at the end after this long; `wandb sync` later


def init_logging(rank: int = 0, level: int = logging.INFO) -> None:
    """One log format for every process; non-zero ranks only report warnings.

    Log files already attached to the root logger (Hydra's `<run dir>/<job name>.log`) are
    kept, in this format: replacing every handler left that file empty in every run dir."""
    fmt = f"[%(asctime)s r{rank}] %(message)s"
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    logging.basicConfig(
        level=level if rank == 0 else logging.WARNING,
        format=fmt,
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    root = logging.getLogger()
    for h in files:
        h.setFormatter(root.handlers[0].formatter)
        root.addHandler(h)


class NullLogger:
    """Accepts everything, writes nothing (ranks other than 0)."""

    run_id: str | None = None  # a W&B run's id, kept in checkpoints to continue the run

    def log(self, row: dict[str, Any]) -> None:
        pass

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        pass

    def close(self) -> None:
        pass


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()
    }


class JsonlLogger(NullLogger):
    """One JSON object per line: what people plot (pandas.read_json(..., lines=True))."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = path.open("a", buffering=1)

    def log(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(_clean(row)) + "\n")

    def close(self) -> None:
        self._f.close()


# An evaluation row's "split" is the dataset split it scored: val or test (data.eval_split for
# the periodic ones, eval.final_split for the one after training). Files written before rows
# were named so say "eval" for data.eval_split's rows: readers take it as val, its default.
LEGACY_EVAL = "eval"


def row_split(row: dict[str, Any]) -> str | None:
    """A metrics.jsonl row's split: train, val or test ("eval", written by older runs: val)."""
    split = row.get("split")
    return "val" if split == LEGACY_EVAL else split


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl. A line that is not a JSON object (a rank killed while
    writing it) is skipped with a warning naming the file and line."""
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict):
                log.warning("%s:%d is not a JSON object; skipped", path, n)
                continue
            rows.append(row)
    return rows


# -- Weights & Biases ----------------------------------------------------------------------


def wandb_logged_in() -> bool:
    """Whether W&B credentials are configured, checked locally (no network, no wandb import).

    Credentials are WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE in the environment, or a
    ~/.netrc entry (or $NETRC) for the W&B host: WANDB_BASE_URL's host when set, otherwise
    the hosts `wandb login` writes by default.
    """
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    base = os.environ.get("WANDB_BASE_URL")
    hosts = (urlsplit(base).netloc,) if base else _DEFAULT_WANDB_HOSTS
    path = os.environ.get("NETRC") or next(
        (p for p in (Path.home() / ".netrc", Path.home() / "_netrc") if p.is_file()), None
    )
    if not path:
        return False
    try:
        entries = netrc.netrc(str(path))
    except (OSError, netrc.NetrcParseError) as e:
        log.warning("could not read %s for W&B credentials: %s", path, e)
        return False
    return any((auth := entries.authenticators(h)) and auth[2] for h in hosts)


def wandb_mode(requested: str) -> str:
    """The W&B mode a run uses: `online`, `offline` or `disabled`.

    An explicit `logger.mode` wins (as an argument to wandb.init beats the environment);
    `auto` follows WANDB_MODE (or WANDB_DISABLED) when set, else goes online only when the
    user is logged in (`wandb_logged_in`), so without credentials nothing touches a network.
    Online without credentials becomes offline with a warning: wandb would otherwise prompt
    for a key on a terminal and wait forever.
    """
    mode = _requested_mode(requested)
    if mode == "online" and not wandb_logged_in():
        log.warning(
            "W&B mode online but no credentials (WANDB_API_KEY, `wandb login`); logging "
            "offline instead (upload later with `wandb sync`)"
        )
        return "offline"
    return mode


def _requested_mode(requested: str) -> str:
    if requested != "auto":
        if requested not in WANDB_MODES:
            raise ValueError(f"logger.mode={requested!r} is not one of: {', '.join(WANDB_MODES)}")
        return requested
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env:
        if env not in _ENV_MODES:
            raise ValueError(
                f"WANDB_MODE={os.environ['WANDB_MODE']!r} is not one of: {', '.join(_ENV_MODES)}"
            )
        return _ENV_MODES[env]
    if os.environ.get("WANDB_DISABLED", "").strip().lower() in ("1", "true", "yes"):
        return "disabled"
    return "online" if wandb_logged_in() else "offline"


def _wandb_settings(wandb: Any, mode: str) -> Any:
    """wandb.Settings that cannot block a run: bounded init (and, online, a bounded final
    upload); quiet; no stdout/stderr capture (it would wrap every rank's console)."""
    timeout = float(os.environ.get("WANDB_INIT_TIMEOUT", INIT_TIMEOUT_S))
    wanted: dict[str, Any] = {"init_timeout": timeout, "silent": True, "console": "off"}
    if mode == "online":
        wanted["finish_timeout"] = FINISH_TIMEOUT_S
    known = getattr(wandb.Settings, "model_fields", None)  # older wandb lacks some settings
    if known is not None:
        wanted = {k: v for k, v in wanted.items() if k in known}
    return wandb.Settings(**wanted)


class WandbLogger(NullLogger):
    """A W&B run in <run dir>/wandb; offline unless logged in; a failure is only a warning.

    Rows are logged at their `step`, with keys prefixed by their split (`train/loss`,
    `val/auc`, `test/hr@10`, ...) so dashboards group them; each run summarises the val
    split's headline metrics at their best (AUC, HR@K, NDCG@K: highest; RMSE, MAE: lowest);
    `log_table` adds a wandb.Table at the latest step. The run name is WANDB_NAME (set per
    job by sweeps) or the run directory's name.
    """

    def __init__(
        self,
        run_dir: Path,
        project: str,
        mode: str,
        config: dict[str, Any],
        entity: str | None = None,
        tags: list[str] | None = None,
        run_id: str | None = None,
    ) -> None:
        """`run_id`: continue that run (a resumed training run, from its checkpoint)."""
        self.mode = wandb_mode(mode)
        self.run: Any = None
        self._step = 0
        if self.mode == "disabled":
            log.info("W&B disabled (logger.mode / WANDB_MODE); metrics go to metrics.jsonl")
            return
        if self.mode == "offline":
            # wandb's own crash telemetry (on unless disabled) is the one thing an offline run
            # would still send; it is read when wandb starts its service, at the first init.
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        try:
            import wandb  # lazy: an optional integration must not slow or break import

            self._table = wandb.Table
            run_dir.mkdir(parents=True, exist_ok=True)  # wandb looks for a git repo from here
            self.run = wandb.init(
                project=project,
                entity=entity,
                dir=str(run_dir.resolve()),
                config=config,
                mode=self.mode,
                tags=tags or None,
                name=os.environ.get("WANDB_NAME") or run_dir.name,
                settings=_wandb_settings(wandb, self.mode),
                **({"id": run_id, "resume": "allow"} if run_id else {}),
            )
        except Exception as e:  # W&B must never end a training run
            self.run = None
            log.warning(
                "W&B (%s mode) could not start, continuing with metrics.jsonl only: %s: %s",
                self.mode,
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            return
        for key, summary in _summaries(config):
            if self.run is not None:  # the task's metrics: AUC, RMSE and MAE, or HR and NDCG
                self._call("define_metric", self.run.define_metric, key, summary=summary)
        if self.run is not None:
            self.run_id = self.run.id
            where = Path(self.run.dir).parent  # <run dir>/wandb/<offline-run-...>
            resumed = " (continued from the checkpoint)" if run_id else ""
            log.info("W&B run %s%s (%s) in %s", self.run.id, resumed, self.mode, where)
            if self.mode == "offline":
                log.info("upload it later with: wandb sync %s", where)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run a W&B call; on failure warn once and stop logging to W&B."""
        try:
            fn(*args, **kwargs)
        except Exception as e:
            log.warning("W&B %s failed, no more W&B logging in this run: %s", what, e)
            self.run = None

    def log(self, row: dict[str, Any]) -> None:
        if self.run is None:
            return
        split = row.get("split")
        data = {
            (f"{split}/{k}" if split else k): v
            for k, v in row.items()
            if k not in ("step", "split") and v is not None
        }
        if row.get("step") is not None:
            self._step = int(row["step"])
        self._call("log", self.run.log, data, step=self._step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        if self.run is None:
            return
        table = self._table(columns=list(columns), data=[list(r) for r in rows])
        self._call("log_table", self.run.log, {name: table}, step=self._step)

    def close(self) -> None:
        if self.run is not None:
            self._call("finish", self.run.finish)
            self.run = None


def _summaries(config: dict[str, Any]) -> list[tuple[str, str]]:
    """The val split's headline metrics and how W&B summarises each (the run's config)."""
    out = [("val/auc", "max"), ("val/rmse", "min"), ("val/mae", "min")]
    if (config.get("model") or {}).get("task") == "retrieval":
        for k in (config.get("eval") or {}).get("topk") or []:
            out += [(f"val/hr@{k}", "max"), (f"val/ndcg@{k}", "max")]
    return out


class MultiLogger(NullLogger):
    def __init__(self, loggers: list[NullLogger]) -> None:
        self.loggers = loggers
        self.run_id = next((lg.run_id for lg in loggers if lg.run_id), None)

    def log(self, row: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.log(row)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        for lg in self.loggers:
            lg.log_table(name, columns, rows)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def truncate_metrics(path: Path, step: int) -> None:
    """After a resume, drop rows logged past the checkpoint (they will be logged again)."""
    if not path.is_file():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
