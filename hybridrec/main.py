"""`python -m hybridrec.main` / `hybridrec-train`: Hydra entry point, kept thin.

Composes conf/train.yaml (the schema's defaults, then its groups) and any overrides,
validates it into a typed Config, then either trains in this process (joining the process
group when started by torchrun, or when sharding needs one) or, with
`launcher.nproc_per_node` > 1 and no torchrun, starts that many local ranks of itself
(hybridrec.train.sweep), which is also what each job of a `-m` sweep does.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hybridrec.config import (
    CONF_DIR,
    Config,
    check_override_keys,
    register_schema,
    resolve_run_length,
)
from hybridrec.configure import validate
from hybridrec.distributed.env import (
    destroy_distributed,
    init_distributed,
    launched_by_torchrun,
    resolve_device,
)
from hybridrec.train.exits import (
    FAILED_EXIT,
    PREEMPTED_EXIT,
    RUN_ERRORS,
    USAGE_EXIT,
    fail,
    show_traceback,
)
from hybridrec.train.loggers import init_logging
from hybridrec.train.sweep import (
    RanksFailed,
    check_launch,
    environ,
    final_metrics,
    launch_ranks,
    objective,
    wandb_environ,
)

log = logging.getLogger("hybridrec")


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _run_id() -> str:
    """One run-directory name for all ranks of a job.

    Every rank resolving ${now:} itself can straddle a second boundary and split the run over
    two directories. HYBRIDREC_RUN_ID (set by launch/ scripts) or a rendezvous id given to
    torchrun win; otherwise (a bare or `--standalone` torchrun, whose id is a random uuid) all
    local ranks share their parent agent, so its start time names the run: <date>/<time>.
    """
    if os.environ.get("HYBRIDREC_RUN_ID"):
        return os.environ["HYBRIDREC_RUN_ID"]
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if rdzv not in ("", "none") and not _UUID.fullmatch(rdzv):  # --standalone: a random uuid
        return rdzv
    start = time.time()
    if launched_by_torchrun():
        try:
            start = os.stat(f"/proc/{os.getppid()}").st_mtime
        except OSError:
            pass
    return time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(start))


OmegaConf.register_new_resolver("hybridrec_run_id", _run_id, use_cache=True, replace=True)
register_schema()  # conf/train.yaml's defaults list starts with the schema's defaults


def _validated(raw: DictConfig) -> tuple[Config, bool]:
    """The typed config, checked against the world size the run will have, and whether this
    process should launch the ranks itself (rather than be one). The command line's
    train.steps or train.epochs wins over the other from a preset (resolve_run_length)."""
    raw = resolve_run_length(raw, HydraConfig.get().overrides.task)
    cfg = validate(raw)
    nproc = cfg.launcher.nproc_per_node
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if nproc not in (1, world) and int(os.environ.get("RANK", 0)) == 0:
            log.warning(
                "launcher.nproc_per_node=%d has no effect under torchrun (WORLD_SIZE=%d)",
                nproc,
                world,
            )
        return validate(raw, world_size=world), False
    if nproc > 1:
        return validate(raw, world_size=nproc), True
    return cfg, False


def _train(cfg: Config, run_dir: Path) -> float | None:
    env = init_distributed(cfg.device, cfg.dist.timeout_s, force_group=cfg.sharding.type != "none")
    ok = False
    trainer = None
    try:
        from hybridrec.train.trainer import Trainer

        if env.is_main:
            log.info("run dir %s", run_dir)
        trainer = Trainer(cfg, env, run_dir)
        result = trainer.evaluate_only() if cfg.eval.only else trainer.fit()
        ok = True
        preempted_at = trainer.step if result.get("preempted") else None
    finally:
        # Free the model (DDP's reducer and the collectives' work objects) while the
        # interpreter is fully alive: left to the last garbage collection at exit, gloo's
        # worker threads can abort the process ("terminate called without an active
        # exception", pytorch/pytorch#190489) after a run that succeeded.
        del trainer
        gc.collect()
        destroy_distributed(env, barrier=ok)
    if preempted_at is not None:
        fail(
            f"stopped on a signal after saving checkpoint step {preempted_at} in "
            f"{cfg.checkpoint.dir}; run the same command again to resume",
            PREEMPTED_EXIT,
        )
    return objective(result["eval"])


# An absolute path: a relative one resolves against the calling *module* when this runs as the
# `hybridrec-train` console script (not `python -m`), which Hydra reads as package "conf".
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(raw: DictConfig) -> float | None:
    """Train (or launch the ranks that train); returns the final eval AUC (regression: RMSE)
    for Hydra sweeps."""
    init_logging(int(os.environ.get("RANK", 0)))
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN or show_traceback():  # a sweep records each job's error
        return _run(raw, Path(hydra_cfg.runtime.output_dir))
    try:
        cfg, launch = _validated(raw)
        if launch:
            check_launch(cfg)
        else:  # device=cuda without CUDA is the config's error too (exit 2), found before it runs
            resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as e:  # the config: nothing ran
        fail(str(e), USAGE_EXIT)
    try:
        return _run_validated(cfg, launch, Path(hydra_cfg.runtime.output_dir))
    except RanksFailed as e:
        fail(str(e), e.exitcode)
    except RUN_ERRORS as e:
        fail(f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e), FAILED_EXIT)


def _run(raw: DictConfig, run_dir: Path) -> float | None:
    cfg, launch = _validated(raw)
    return _run_validated(cfg, launch, run_dir)


def _run_validated(cfg: Config, launch: bool, run_dir: Path) -> float | None:
    if launch:
        launch_ranks(cfg, run_dir)
        return objective(final_metrics(run_dir / "metrics.jsonl"))
    with environ(**wandb_environ()):  # a sweep job training in this process
        return _train(cfg, run_dir)


def cli() -> None:
    """Console entry (`hybridrec-train`, `python -m hybridrec.main`): catch misspelt keys
    with the list of valid ones before Hydra composes anything."""
    try:
        check_override_keys(sys.argv[1:])
    except ValueError as e:
        fail(str(e), USAGE_EXIT)
    main()


if __name__ == "__main__":
    cli()
