"""`python -m hybridrec.main` / `hybridrec-train`: Hydra entry point, kept thin.

Composes conf/train.yaml with its groups and any overrides, validates it into a typed Config,
joins the process group when started by torchrun (or when sharding needs one), and trains.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from hybridrec.config import validate
from hybridrec.distributed.env import destroy_distributed, init_distributed, launched_by_torchrun
from hybridrec.train.loggers import init_logging

log = logging.getLogger("hybridrec")


def _run_id() -> str:
    """One run-directory name for all ranks of a job.

    Every rank resolving ${now:} itself can straddle a second boundary and split the run over
    two directories. HYBRIDREC_RUN_ID (set by launch/ scripts) or torchrun's rendezvous id win;
    under a bare torchrun all local ranks share their parent agent, so its start time is used.
    """
    if os.environ.get("HYBRIDREC_RUN_ID"):
        return os.environ["HYBRIDREC_RUN_ID"]
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if rdzv not in ("", "none"):
        return rdzv
    start = time.time()
    if launched_by_torchrun():
        try:
            start = os.stat(f"/proc/{os.getppid()}").st_mtime
        except OSError:
            pass
    return time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(start))


OmegaConf.register_new_resolver("hybridrec_run_id", _run_id, use_cache=True, replace=True)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(raw: DictConfig) -> float | None:
    rank = int(os.environ.get("RANK", 0))
    init_logging(rank)
    world = int(os.environ.get("WORLD_SIZE", 1)) if launched_by_torchrun() else 1
    cfg = validate(raw, world_size=world)
    env = init_distributed(cfg.device, cfg.dist.timeout_s, force_group=cfg.sharding.type != "none")
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    ok = False
    try:
        from hybridrec.train.trainer import Trainer

        if env.is_main:
            log.info("run dir %s", run_dir)
        result = Trainer(cfg, env, run_dir).fit()
        ok = True
    finally:
        destroy_distributed(env, barrier=ok)
    auc = result["eval"].get("auc")
    return None if auc is None else float(auc)


if __name__ == "__main__":
    main()
