"""Where metrics go: <run dir>/metrics.jsonl always, the console, and W&B with logger=wandb.

Only rank 0 logs (other ranks get a NullLogger). W&B is imported lazily and runs offline
unless the user is logged in (or sets WANDB_MODE=online), so it never needs a network.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("hybridrec")


def init_logging(rank: int = 0, level: int = logging.INFO) -> None:
    """One log format for every process; non-zero ranks only report warnings."""
    fmt = f"[%(asctime)s r{rank}] %(message)s"
    logging.basicConfig(
        level=level if rank == 0 else logging.WARNING,
        format=fmt,
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


class NullLogger:
    """Accepts everything, writes nothing (ranks other than 0)."""

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


def wandb_mode(requested: str) -> str:
    """`auto`: online when an API key is configured (env or ~/.netrc), else offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "online" if "api.wandb.ai" in netrc.read_text() else "offline"
    except OSError:
        return "offline"


class WandbLogger(NullLogger):
    """Weights & Biases run in <run dir>/wandb; offline unless logged in."""

    def __init__(
        self,
        run_dir: Path,
        project: str,
        mode: str,
        config: dict[str, Any],
        entity: str | None = None,
        tags: list[str] | None = None,
    ) -> None:
        import wandb  # lazy: an optional integration must not slow or break import

        self.mode = wandb_mode(mode)
        self._wandb = wandb
        self.run = wandb.init(
            project=project,
            entity=entity,
            dir=str(run_dir),
            config=config,
            mode=self.mode,
            tags=tags or None,
            name=run_dir.name,
            settings=wandb.Settings(init_timeout=60, silent=True, console="off"),
        )
        log.info("W&B run %s (%s) in %s", self.run.id, self.mode, run_dir / "wandb")

    def log(self, row: dict[str, Any]) -> None:
        step = row.get("step")
        self.run.log({k: v for k, v in _clean(row).items() if k != "step"}, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({name: self._wandb.Table(columns=columns, data=rows)})

    def close(self) -> None:
        self.run.finish()


class MultiLogger(NullLogger):
    def __init__(self, loggers: list[NullLogger]) -> None:
        self.loggers = loggers

    def log(self, row: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.log(row)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        for lg in self.loggers:
            lg.log_table(name, columns, rows)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()
