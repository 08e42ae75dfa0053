"""The training loop: one global batch per step, split evenly over ranks.

Per step each rank takes its slice of global batch `step`, runs forward (embeddings, then the
dense part under bf16 autocast on GPU), backward (which also updates the embedding rows,
see hybridrec.sparse.fused) and one dense optimizer step. Every `train.log_every` steps rank 0
logs the global mean loss and samples/s; every `eval.every` steps and at the end it logs exact
AUC, log loss and accuracy over the held-out split, gathered from all ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from hybridrec.config import Config
from hybridrec.data import build_loader, build_source
from hybridrec.distributed.env import DistEnv
from hybridrec.model import loss_fn
from hybridrec.optim import build_dense_optimizer
from hybridrec.parallelize import build_model
from hybridrec.train.loggers import JsonlLogger, MultiLogger, NullLogger, WandbLogger
from hybridrec.train.metrics import eval_metrics
from hybridrec.types import Batch

log = logging.getLogger("hybridrec")


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf; the message names the step."""


def build_loggers(cfg: Config, env: DistEnv, run_dir: Path) -> NullLogger:
    if not env.is_main:
        return NullLogger()
    loggers: list[NullLogger] = [JsonlLogger(run_dir / "metrics.jsonl")]
    if cfg.logger.name == "wandb":
        loggers.append(
            WandbLogger(
                run_dir,
                cfg.logger.project,
                cfg.logger.mode,
                dataclasses.asdict(cfg),
                cfg.logger.entity,
                list(cfg.logger.tags),
            )
        )
    return MultiLogger(loggers)


class Trainer:
    """Owns the model, its optimizers and the data stream for one run."""

    def __init__(self, cfg: Config, env: DistEnv, run_dir: Path | None = None) -> None:
        self.cfg, self.env = cfg, env
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.source = build_source(cfg)
        self.model, self.plan = build_model(cfg, env)
        self.dense_opt = build_dense_optimizer(
            self.model.dense.parameters(), cfg.optim.dense, env.device
        )
        self.local_batch = cfg.train.batch_size // env.world_size
        cuda = env.device.type == "cuda"
        self.autocast = torch.autocast(
            device_type=env.device.type,
            dtype=torch.bfloat16,
            enabled=cuda and cfg.train.autocast == "bf16",
        )
        self.logger = build_loggers(cfg, env, self.run_dir) if self.run_dir else NullLogger()
        self.history: list[dict[str, Any]] = []

    # -- data -------------------------------------------------------------------------------
    def loader(self, split: str = "train", start_step: int = 0):  # noqa: ANN201
        batch = self.cfg.train.batch_size if split == "train" else self.cfg.eval.batch_size
        return build_loader(
            self.cfg, self.source, self.env.rank, self.env.world_size, batch, split, start_step
        )

    def train_batch(self, step: int) -> Batch:
        """This rank's slice of global training batch `step` (random access, for tests)."""
        loader = self.loader("train", step)
        try:
            return next(loader)
        finally:
            loader.close()

    # -- steps ------------------------------------------------------------------------------
    def train_step(self, batch: Batch) -> torch.Tensor:
        """One optimizer step on this rank's batch; returns the local mean loss (no sync)."""
        self.model.train()
        batch = batch.to(self.env.device, non_blocking=True)
        with self.autocast:
            logits = self.model(batch.dense, batch.ids)
        loss = loss_fn(logits, batch.labels)
        self.dense_opt.zero_grad(set_to_none=True)
        loss.backward()  # also applies the sparse optimizer to the touched embedding rows
        self.dense_opt.step()
        return loss.detach()

    def global_mean(self, value: torch.Tensor) -> float:
        """Mean of a per-rank scalar over ranks (ranks hold equal batch slices)."""
        if self.env.group is not None:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.env.group)
            value /= self.env.world_size
        return float(value)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact metrics over `eval.batches` held-out global batches (same on every rank)."""
        self.model.eval()
        logits, labels = [], []
        loader = self.loader("eval")
        for _, batch in zip(range(self.cfg.eval.batches), loader, strict=False):
            batch = batch.to(self.env.device)
            with self.autocast:
                logits.append(self.model(batch.dense, batch.ids).float())
            labels.append(batch.labels)
        loader.close()
        if not logits:
            return {}
        local = torch.stack([torch.cat(logits), torch.cat(labels)])
        if self.env.group is not None:
            parts = [torch.empty_like(local) for _ in range(self.env.world_size)]
            dist.all_gather(parts, local, group=self.env.group)
            local = torch.cat(parts, dim=1)
        metrics = eval_metrics(local[0], local[1])
        metrics["eval_samples"] = int(local.shape[1])
        return metrics

    # -- loop -------------------------------------------------------------------------------
    def _progress(self, steps: int) -> tqdm | None:
        mode = self.cfg.train.progress
        use_bar = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
        if not self.env.is_main or not use_bar:
            return None
        return tqdm(total=steps, desc="train", unit="step", dynamic_ncols=True)

    def _record(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        self.logger.log(row)

    def fit(self) -> dict[str, Any]:
        """Train for `train.steps` steps; returns the last train row and final eval metrics."""
        cfg, env = self.cfg, self.env
        steps, every = cfg.train.steps, cfg.eval.every
        bar = self._progress(steps)
        log.info(
            "training %d steps, global batch %d (%d per rank x %d ranks) on %s",
            steps,
            cfg.train.batch_size,
            self.local_batch,
            env.world_size,
            env.device,
        )
        t_last, n_last = time.perf_counter(), 0
        last_train: dict[str, Any] = {}
        final_eval: dict[str, float] = {}
        loader = self.loader("train", 0)
        for step in range(1, steps + 1):
            loss = self.train_step(next(loader))
            if step % cfg.train.log_every == 0 or step == steps:
                mean_loss = self.global_mean(loss)
                if not math.isfinite(mean_loss):
                    raise NonFiniteLossError(
                        f"loss is {mean_loss} at step {step}; lower the learning rates "
                        "(optim.dense.lr, optim.sparse.lr) or check the data"
                    )
                if env.device.type == "cuda":
                    torch.cuda.synchronize(env.device)
                now = time.perf_counter()
                rate = (step - n_last) * cfg.train.batch_size / (now - t_last)
                t_last, n_last = now, step
                last_train = {
                    "step": step,
                    "split": "train",
                    "loss": mean_loss,
                    "samples_per_sec": rate,
                }
                self._record(last_train)
                if bar is not None:
                    bar.set_postfix(loss=f"{mean_loss:.4f}", sps=f"{rate:,.0f}")
                else:
                    log.info("step %d/%d  loss %.5f  %.0f samples/s", step, steps, mean_loss, rate)
            if (every and step % every == 0) or step == steps:
                final_eval = self.evaluate()
                if final_eval:
                    self._record({"step": step, "split": "eval", **final_eval})
                    log.info(
                        "eval @ step %d  auc %.4f  logloss %.4f  accuracy %.4f",
                        step,
                        final_eval["auc"],
                        final_eval["logloss"],
                        final_eval["accuracy"],
                    )
                t_last = time.perf_counter()  # eval time is not training throughput
            if bar is not None:
                bar.update(1)
        loader.close()
        if bar is not None:
            bar.close()
        self.logger.close()
        return {"train": last_train, "eval": final_eval}
