"""The training loop: one global batch per step, split evenly over ranks.

Per step each rank takes its slice of global batch `step`, runs forward (embeddings, then the
dense part under bf16 autocast on GPU), backward (which also updates the embedding rows,
see hybridrec.sparse.fused) and one dense optimizer step. Every `train.log_every` steps rank 0
logs the global mean loss, samples/s, per-phase timings and memory; every `eval.every` steps
and at the end it logs exact AUC, log loss, normalized entropy, calibration and accuracy over
the held-out split, gathered
from all ranks. With `checkpoint.dir` set it saves every `checkpoint.every` steps and at the
end, and resumes from the newest complete checkpoint (`checkpoint.resume=auto`), so a job
restarted by torchrun continues the same stream and ends with the same weights.

A NaN or inf loss is caught without a host sync per step: a device-side flag remembers the
first bad step and is read at the next log or checkpoint (`train.nonfinite=error`). The
`skip` policy must decide before the backward (which applies the sparse update), so it reads
the loss every step and drops that step's update on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from hybridrec.config import Config
from hybridrec.data import build_loader, build_source
from hybridrec.data.device import DevicePrefetcher
from hybridrec.data.loader import BatchSource
from hybridrec.distributed.comm import any_rank
from hybridrec.distributed.env import DistEnv
from hybridrec.model import loss_fn
from hybridrec.optim import LRSchedule, build_dense_optimizer
from hybridrec.parallelize import build_model
from hybridrec.sparse.host import CacheStats
from hybridrec.timing import PhaseTimer
from hybridrec.train.checkpoint import (
    CheckpointError,
    TrainState,
    check_writable,
    checkpoint_step,
    init_from_export,
    load_checkpoint,
    model_signature,
    read_manifest,
    resolve_resume,
    save_checkpoint,
)
from hybridrec.train.loggers import JsonlLogger, MultiLogger, NullLogger, WandbLogger
from hybridrec.train.metrics import eval_metrics
from hybridrec.train.preemption import PreemptionGuard
from hybridrec.train.profile import STEP, StepProfiler
from hybridrec.types import Batch

log = logging.getLogger("hybridrec")


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf; the message names the step."""


def build_loggers(
    cfg: Config, env: DistEnv, run_dir: Path, wandb_run_id: str | None = None
) -> NullLogger:
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
                wandb_run_id,
            )
        )
    return MultiLogger(loggers)


def steps_for_epochs(epochs: float, source: BatchSource, batch_size: int) -> int:
    """`train.epochs` as steps: epochs x (train rows // global batch), rounded up."""
    per_epoch = source.steps_per_epoch(batch_size, "train")
    if per_epoch is None:  # validate() refuses synthetic data; another endless source
        raise ValueError(f"train.epochs={epochs}: this dataset is endless; set train.steps")
    steps = max(1, math.ceil(epochs * per_epoch - 1e-9))
    log.info(
        "train.epochs=%g: %d steps (one epoch = %d steps of %d samples)",
        epochs,
        steps,
        per_epoch,
        batch_size,
    )
    return steps


class Trainer:
    """Owns the model, its optimizers and the data stream for one run."""

    def __init__(self, cfg: Config, env: DistEnv, run_dir: Path | None = None) -> None:
        self.cfg, self.env = cfg, env
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.source = build_source(cfg)
        if cfg.train.epochs is not None:
            cfg.train.steps = steps_for_epochs(cfg.train.epochs, self.source, cfg.train.batch_size)
        self.model, self.plan = build_model(cfg, env)
        self.model.dense = compile_dense(self.model.dense, cfg.train.compile, env.device)
        self.dense_opt = build_dense_optimizer(
            self.model.dense.parameters(), cfg.optim.dense, env.device
        )
        self.schedule = LRSchedule(cfg.optim.schedule, cfg.optim.dense.lr, cfg.optim.sparse.lr)
        # one row optimizer is shared by the groups; collected once, in case a group has its own
        self._sparse_opts = list(
            {
                id(g.optimizer): g.optimizer
                for g in self.model.embeddings.groups.values()
                if g.optimizer is not None
            }.values()
        )
        self.lr = (cfg.optim.dense.lr, cfg.optim.sparse.lr)  # (dense, sparse) of the last step
        self.local_batch = cfg.train.batch_size // env.world_size
        cuda = env.device.type == "cuda"
        self.autocast = torch.autocast(
            device_type=env.device.type,
            dtype=torch.bfloat16,
            enabled=cuda and cfg.train.autocast == "bf16",
        )
        # Which checkpoint a resume will load is known now; rows logged after it (by a run
        # that crashed) are dropped before the loggers open the file, then logged again.
        self.resume_from = resolve_resume(cfg.checkpoint.dir, cfg.checkpoint.resume)
        if self.resume_from is not None and env.is_main and self.run_dir is not None:
            _truncate_metrics(self.run_dir / "metrics.jsonl", checkpoint_step(self.resume_from))
        wandb_run_id = None  # a resumed run continues its W&B run, not a new one
        if self.resume_from is not None and env.is_main:
            extra = read_manifest(self.resume_from, verify=False).get("extra", {})
            wandb_run_id = extra.get("wandb_run_id")
        self.logger = (
            build_loggers(cfg, env, self.run_dir, wandb_run_id) if self.run_dir else NullLogger()
        )
        self.history: list[dict[str, Any]] = []
        self.timer = PhaseTimer(env.device)
        self.model.embeddings.timer = self.timer
        self.has_host = bool(getattr(self.model.embeddings, "has_host", False))
        # (host batch, its device copy): the upcoming batch whose rows were prefetched, so the
        # next step trains on the very ids the prefetch saw (and does not copy them again)
        self._staged: tuple[Batch, Batch] | None = None
        for group in self.model.embeddings.groups.values():
            group.timer = self.timer
        self.signature = model_signature(
            list(cfg.model.tables()), self.model, cfg.optim.sparse.name, cfg.optim.dense.name
        )
        self.step = 0  # optimizer steps done
        self.skipped = 0  # steps dropped by train.nonfinite=skip
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=env.device)

    def warm_start_caches(self) -> int:
        """Load each host cache's most frequent rows, when the data source knows its id
        frequencies (a manifest's counts, or synthetic data's popularity); returns the rows
        loaded on this rank."""
        counts = getattr(self.source, "id_counts", None)
        if counts is None:
            log.info("host caches start empty (the data source records no id frequencies)")
            return 0
        emb = self.model.embeddings
        loaded = emb.warm_start_caches(counts, self.cfg.train.batch_size)
        log.info("host caches warm-started with %d rows from the dataset's id counts", loaded)
        rate = emb.warm_hit_rate()
        if rate is not None:
            log.info(
                "host caches: expected hit rate %.3f of each batch's distinct rows while ids "
                "follow those counts (the best any fixed set of rows this size does)",
                rate,
            )
        return loaded

    # -- data -------------------------------------------------------------------------------
    def loader(self, split: str = "train", start_step: int = 0):  # noqa: ANN201
        batch = self.cfg.train.batch_size if split == "train" else self.cfg.eval.batch_size
        return build_loader(
            self.cfg,
            self.source,
            self.env.rank,
            self.env.world_size,
            batch,
            split,
            start_step,
            group=self.env.group,
        )

    def train_batch(self, step: int) -> Batch:
        """This rank's slice of global training batch `step` (random access, for tests)."""
        loader = self.loader("train", step)
        try:
            return next(loader)
        finally:
            loader.close()

    # -- steps ----------------------------------------------------------------------------
    def train_step(self, batch: Batch, upcoming: Batch | None = None) -> torch.Tensor:
        """One optimizer step on this rank's batch (counted in `self.step`, which sets the
        learning-rate schedule); returns the local mean loss (no sync).

        `upcoming` (the next batch, when tables are host-resident) has its rows brought to
        the device caches while this step's backward runs (hybridrec.sparse.host)."""
        with self.timer.region(STEP):
            return self._train_step(batch, upcoming)

    def _train_step(self, batch: Batch, upcoming: Batch | None) -> torch.Tensor:
        self.model.train()
        if self.schedule.enabled:  # the sparse rate must be set before the backward uses it
            self.lr = self.schedule.apply(self.step + 1, self.dense_opt, self._sparse_opts)
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] is batch:
            batch = staged[1]
        else:
            batch = batch.to(self.env.device, non_blocking=True)
        with self.timer.phase("forward"), self.autocast:
            logits = self.model(batch.dense, batch.ids)
        loss = loss_fn(logits, batch.labels)
        if upcoming is not None:
            self._staged = (upcoming, upcoming.to(self.env.device, non_blocking=True))
            self.model.embeddings.prefetch(self._staged[1].ids)
        self.dense_opt.zero_grad(set_to_none=True)
        if self.cfg.train.nonfinite == "skip" and not self._all_finite(loss):
            self.skipped += 1
            self.step += 1
            log.warning(
                "non-finite loss at step %d: update skipped (%d so far)",
                self.step,
                self.skipped,
            )
            return loss.detach()
        with self.timer.phase("backward"):
            loss.backward()  # also applies the sparse optimizer to the touched embedding rows
        with self.timer.phase("dense_optimizer"):
            self.dense_opt.step()
        bad = ~torch.isfinite(loss.detach())
        self._first_bad = torch.where(bad & (self._first_bad < 0), self.step + 1, self._first_bad)
        self.step += 1
        return loss.detach()

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank (a collective: every rank calls it)."""
        if self.env.group is None:
            return flag
        return any_rank(flag, self.env.group, self.env.device)

    def _all_finite(self, loss: torch.Tensor) -> bool:
        ok = torch.isfinite(loss.detach()).to(torch.int64)
        if self.env.group is not None:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.env.group)
        return bool(ok.item())

    def check_inputs(self) -> None:
        """Raise if a deferred id check (CUDA, see hybridrec.sparse.collection.IdChecker) met
        an out-of-range id since the last call; collective on several ranks."""
        raise_bad_ids = getattr(self.model.embeddings, "raise_bad_ids", None)
        if raise_bad_ids is not None:
            raise_bad_ids()

    def check_finite(self) -> None:
        """Raise if any step so far had a NaN or inf loss, naming the first such step."""
        first = self._first_bad.clone()
        if self.env.group is not None:
            dist.all_reduce(first, op=dist.ReduceOp.MAX, group=self.env.group)
        if int(first) >= 0:
            raise NonFiniteLossError(
                f"loss became NaN or inf at step {int(first)}; lower the learning rates "
                "(optim.dense.lr, optim.sparse.lr), check the data, or set "
                "train.nonfinite=skip to drop such steps"
            )

    def global_mean(self, value: torch.Tensor) -> float:
        """Mean of a per-rank scalar over ranks (ranks hold equal batch slices)."""
        if self.env.group is not None:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.env.group)
            value /= self.env.world_size
        return float(value)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact metrics over `eval.batches` held-out global batches, or the whole split
        (None); the same on every rank and for any world size.

        A file split's last batch is filled by wrapping around to its start; samples at
        global positions past the split's rows are masked out, so every row counts once."""
        self.model.eval()
        batch_size, world = self.cfg.eval.batch_size, self.env.world_size
        local_batch = batch_size // world
        split_rows = getattr(self.source, "split_rows", None)
        rows = split_rows("eval") if split_rows is not None else None
        first = self.env.rank * local_batch + torch.arange(local_batch, device=self.env.device)
        logits, labels, real = [], [], []
        loader = self.loader("eval")
        for step, batch in enumerate(itertools.islice(loader, self.cfg.eval.batches)):
            batch = batch.to(self.env.device)
            with self.autocast:
                logits.append(self.model(batch.dense, batch.ids).float())
            labels.append(batch.labels)
            real.append(first + step * batch_size < (rows if rows is not None else math.inf))
        loader.close()
        self.check_inputs()  # no metrics from batches with bad ids
        if not logits:
            return {}
        local = torch.stack([torch.cat(logits), torch.cat(labels), torch.cat(real).float()])
        if self.env.group is not None:
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local, group=self.env.group)
            local = torch.cat(parts, dim=1)
        local = local[:, local[2] > 0]
        metrics = eval_metrics(local[0], local[1])
        metrics["eval_samples"] = int(local.shape[1])
        return metrics

    # -- checkpoints ----------------------------------------------------------------------
    def restore(self) -> None:
        """Resume from a checkpoint (checkpoint.resume) or warm-start (model.init_from)."""
        ck, path = self.cfg.checkpoint, self.resume_from
        if path is not None:
            state = load_checkpoint(path, self.model, self.dense_opt, self.signature, ck.verify)
            self.step = state.step
            self.skipped = int(state.extra.get("skipped", 0))
            log.info("resumed from %s at step %d", path, self.step)
            saved = state.extra.get("stream")
            changed = [
                f"{k} {saved[k]!r} -> {v!r}"
                for k, v in self._stream().items()
                if saved is not None and k in saved and saved[k] != v
            ]
            if changed and self.env.is_main and not self.cfg.eval.only:  # eval.only: no stream
                log.warning(
                    "resuming with a different training stream (%s): training continues at "
                    "global batch %d of the new stream, not where the saved run stopped, so "
                    "the result will differ from an uninterrupted run",
                    "; ".join(changed),
                    self.step,
                )
        elif self.cfg.model.init_from:
            init_from_export(
                Path(self.cfg.model.init_from), self.model, list(self.cfg.model.tables())
            )
            log.info("initialised weights from %s", self.cfg.model.init_from)

    def evaluate_only(self) -> dict[str, Any]:
        """eval.only: load the checkpoint (or model.init_from), evaluate, log one eval row."""
        self.restore()
        if self.resume_from is None and not self.cfg.model.init_from:
            raise CheckpointError(
                f"eval.only: no complete checkpoint under checkpoint.dir={self.cfg.checkpoint.dir}"
                " to evaluate (checkpoint.resume=never, or none saved yet)"
            )
        metrics = self.evaluate()
        if metrics:
            self._record({"step": self.step, "split": "eval", **metrics})
            self._log_eval(metrics)
        self.logger.close()
        return {"train": {}, "eval": metrics}

    def _log_eval(self, metrics: dict[str, float]) -> None:
        log.info(
            "eval @ step %d  auc %.4f  logloss %.4f  ne %.4f  calibration %.3f  accuracy %.4f  "
            "(%d samples of split %r)",
            self.step,
            metrics["auc"],
            metrics["logloss"],
            metrics["ne"],
            metrics["calibration"],
            metrics["accuracy"],
            metrics["eval_samples"],
            self.cfg.data.eval_split,
        )

    def _stream(self) -> dict[str, Any]:
        """What decides which samples global batch k holds: a resume with other values
        continues a different stream (warned about in restore)."""
        d = self.cfg.data
        return {
            "train.batch_size": self.cfg.train.batch_size,
            "seed": self.cfg.seed,
            "data.name": d.name,
            "data.path": d.path,
            "data.shuffle": d.shuffle,
            "data.last_batch": d.last_batch,
            "data.zipf_exponent": d.zipf_exponent,
            "data.teacher_scale": d.teacher_scale,
            "data.label_noise": d.label_noise,
        }

    def save(self) -> Path | None:
        ck = self.cfg.checkpoint
        if not ck.dir:
            return None
        self.check_inputs()  # never checkpoint poisoned weights
        self.check_finite()
        extra = {
            "skipped": self.skipped,
            "stream": self._stream(),
            "model": dataclasses.asdict(self.cfg.model),  # for hybridrec.model.load_export
        }
        if self.logger.run_id:
            extra["wandb_run_id"] = self.logger.run_id
        state = TrainState(self.step, self.step, extra)
        return save_checkpoint(
            Path(ck.dir),
            state,
            self.model,
            self.dense_opt,
            self.signature,
            self.plan,
            self.env,
            ck.keep,
        )

    # -- loop -------------------------------------------------------------------------------
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

    def _log_train(self, loss: torch.Tensor, steps_since: int, seconds: float) -> dict[str, Any]:
        mean_loss = self.global_mean(loss)
        self.check_inputs()
        self.check_finite()
        phases = self.timer.report(steps_since)
        emb = sum(
            phases.get(k, 0.0) for k in ("input_dist", "lookup", "output_dist", "data_parallel")
        )
        if "forward" in phases:
            phases["dense_forward"] = max(phases.pop("forward") - emb, 0.0)
        row: dict[str, Any] = {
            "step": self.step,
            "split": "train",
            "loss": mean_loss,
            "samples_per_sec": steps_since * self.cfg.train.batch_size / seconds,
            **{f"time_ms/{k}": v for k, v in sorted(phases.items())},
            "mem_gb": _memory_gb(self.env.device),
        }
        if self.schedule.enabled:
            row["lr/dense"], row["lr/sparse"] = self.lr
        if self.skipped:
            row["skipped_steps"] = self.skipped
        if self.has_host:
            row.update(self._cache_metrics(steps_since))
        return row

    def _cache_metrics(self, steps: int) -> dict[str, float]:
        """Host caches over all ranks since the last log: hit rate, rows moved per step (in
        and out), copy bandwidth and time the steps waited on host memory."""
        st = self.model.embeddings.cache_stats() or CacheStats()
        v = torch.tensor(
            [
                st.rows_requested,
                st.hits,
                st.rows_loaded,
                st.rows_written,
                st.bytes_moved,
                st.transfer_s,
                st.wait_s,
            ],
            dtype=torch.float64,
            device=self.env.device,
        )
        if self.env.group is not None:
            dist.all_reduce(v, op=dist.ReduceOp.SUM, group=self.env.group)
        req, hits, rows_in, rows_out, moved, transfer_s, wait_s = v.tolist()
        return {
            "cache/hit_rate": hits / req if req else 1.0,
            "cache/rows_in_per_step": rows_in / steps,
            "cache/rows_out_per_step": rows_out / steps,
            "cache/copy_gb_s": moved / transfer_s / 1e9 if transfer_s else 0.0,
            "time_ms/host_wait": wait_s / self.env.world_size / steps * 1e3,
        }

    def fit(self) -> dict[str, Any]:
        """Train until `train.steps` (resuming if a checkpoint says so); returns the last
        train row, the final eval metrics and whether a stop signal ended it early (with
        checkpoint.dir, SIGTERM and SIGUSR1 save a checkpoint and stop; see
        hybridrec.train.preemption)."""
        cfg, env = self.cfg, self.env
        self.restore()
        if cfg.checkpoint.dir:
            check_writable(Path(cfg.checkpoint.dir), env)
        if self.plan is not None and env.is_main:
            self.logger.log_table(
                "sharding_plan",
                ["table", "sharding", "shards", "reason"],
                [
                    [
                        tp.table,
                        tp.sharding.value,
                        " ".join(
                            f"{s.rank}:r{s.row_start}-{s.row_end}c{s.col_start}-{s.col_end}"
                            for s in tp.shards
                        ),
                        tp.reason,
                    ]
                    for tp in self.plan.tables
                ],
            )
        steps = cfg.train.steps
        bar = self._progress(steps)
        console = contextlib.ExitStack()
        if bar is not None:
            bar.update(self.step)
            # log lines go above the bar (tqdm.write), not onto the end of its line
            console.enter_context(logging_redirect_tqdm())
        log.info(
            "training steps %d..%d, global batch %d (%d per rank x %d ranks) on %s",
            self.step + 1,
            steps,
            cfg.train.batch_size,
            self.local_batch,
            env.world_size,
            env.device,
        )
        if self.step >= steps:
            log.info(
                "the run is already at step %d >= train.steps=%d: nothing to train (raise "
                "train.steps to continue, or eval.only=true to evaluate it)",
                self.step,
                steps,
            )
        if self.has_host:
            self.warm_start_caches()
        loader = DevicePrefetcher(self.loader("train", self.step), self.env.device)
        profiler = None
        if cfg.train.profile_steps:
            out = (self.run_dir or Path.cwd()) / "profile"
            profiler = StepProfiler(
                out,
                env.rank,
                cfg.train.profile_start,
                cfg.train.profile_steps,
                env.device,
                self.timer,
            )
            profiler.after_step(self.step)  # a window starting at step 0 (or the resumed one)
        first, start = self.step, time.perf_counter()
        with PreemptionGuard(enabled=bool(cfg.checkpoint.dir)) as guard:
            try:
                result = self._run_steps(loader, bar, profiler, guard)
            finally:
                loader.close()
                if profiler is not None:
                    profiler.close()
                if bar is not None:
                    bar.close()
                console.close()
        self.logger.close()
        if env.is_main and self.step > first:
            self._log_summary(result, self.step - first, time.perf_counter() - start)
        return result

    def _log_summary(self, result: dict[str, Any], steps: int, wall_s: float) -> None:
        """One closing line: what was trained, the last eval, and where the results are."""
        parts = [
            f"done: {steps} steps in {wall_s:.1f} s "
            f"({steps * self.cfg.train.batch_size / wall_s:,.0f} samples/s with eval and saves)"
        ]
        ev = result.get("eval") or {}
        if ev:
            parts.append(f"eval auc {ev['auc']:.4f} ne {ev['ne']:.4f}")
        if self.run_dir is not None:
            parts.append(
                f"metrics {self.run_dir / 'metrics.jsonl'} (hybridrec-plot {self.run_dir})"
            )
        if self.cfg.checkpoint.dir:
            parts.append(f"checkpoints in {self.cfg.checkpoint.dir}")
        log.info("; ".join(parts))

    def _run_steps(
        self,
        loader: DevicePrefetcher,
        bar: tqdm | None,
        profiler: StepProfiler | None,
        guard: PreemptionGuard,
    ) -> dict[str, Any]:
        """fit()'s loop: steps, logging, evaluation, checkpoints, early and requested stops."""
        cfg, env = self.cfg, self.env
        steps, every, ck_every = cfg.train.steps, cfg.eval.every, cfg.checkpoint.every
        fault = _fault_injection(env.rank)
        t_last, n_last = time.perf_counter(), self.step
        last_train: dict[str, Any] = {}
        final_eval: dict[str, float] = {}
        self.timer.report(1)  # drop anything timed before the loop
        upcoming: Batch | None = None
        preempted = False
        while self.step < steps:
            batch = upcoming if upcoming is not None else next(loader)
            # with host-resident tables, the next batch is read ahead to prefetch its rows
            upcoming = next(loader) if self.has_host and self.step + 1 < steps else None
            loss = self.train_step(batch, upcoming)
            step = self.step
            if profiler is not None:
                profiler.after_step(step)
            if fault is not None and step == fault:
                log.warning("rank %d: fault injection at step %d (HYBRIDREC_FAULT)", env.rank, step)
                os.kill(os.getpid(), signal.SIGKILL)
            log_now = step % cfg.train.log_every == 0 or step == steps
            if log_now:
                if env.device.type == "cuda":
                    torch.cuda.synchronize(env.device)
                last_train = self._log_train(loss, step - n_last, time.perf_counter() - t_last)
                self._record(last_train)
                # every rate in a row covers the steps since the previous row: the phase timer
                # and cache counters reset when read, so the step count and clock restart too
                t_last, n_last = time.perf_counter(), step
                cache = ""
                if "cache/hit_rate" in last_train:  # host-resident tables: how the cache does
                    cache = (
                        f"  cache hit {last_train['cache/hit_rate']:.3f}, "
                        f"{last_train['cache/rows_in_per_step']:,.0f} rows in / "
                        f"{last_train['cache/rows_out_per_step']:,.0f} out per step, "
                        f"waited {last_train['time_ms/host_wait']:.2f} ms/step"
                    )
                if bar is not None:
                    postfix = {
                        "loss": f"{last_train['loss']:.4f}",
                        "sps": f"{last_train['samples_per_sec']:,.0f}",
                    }
                    if cache:
                        postfix["hit"] = f"{last_train['cache/hit_rate']:.3f}"
                    bar.set_postfix(postfix)
                else:
                    log.info(
                        "step %d/%d  loss %.5f  %.0f samples/s%s",
                        step,
                        steps,
                        last_train["loss"],
                        last_train["samples_per_sec"],
                        cache,
                    )
            stop = False
            if log_now and cfg.checkpoint.dir:  # the guard is on: ask every rank
                preempted = self._any_rank(guard.received is not None)
                if preempted:
                    log.warning(
                        "%s received: saving a checkpoint at step %d and stopping; run the "
                        "same command again to resume",
                        guard.received or "a stop signal (on another rank)",
                        step,
                    )
                    stop = True
            if not preempted and ((every and step % every == 0) or step == steps):
                final_eval = self.evaluate()
                if final_eval:
                    self._record({"step": step, "split": "eval", **final_eval})
                    self._log_eval(final_eval)
                    target = cfg.eval.target_auc
                    if target is not None and final_eval["auc"] >= target:
                        log.info("reached eval.target_auc=%.5f at step %d: stopping", target, step)
                        stop = True
            if (ck_every and step % ck_every == 0) or step == steps or stop:
                self.save()
            if (every and step % every == 0) or step == steps or stop:
                self.timer.report(1)
                t_last, n_last = time.perf_counter(), step  # eval/save time is not throughput
            if bar is not None:
                bar.update(1)
            if stop:
                break
        return {"train": last_train, "eval": final_eval, "preempted": preempted}


def compile_dense(dense: nn.Module, mode: str, device: torch.device) -> nn.Module:
    """The dense part as `train.compile` says: torch.compile'd for `dense` (and `auto` on
    CUDA), also replayed as CUDA graphs for `graphs` (static shapes: every step has the same
    local batch, so per-kernel launch overhead goes), unchanged for `none`. The embedding
    side stays eager: its backward runs the optimizer."""
    if mode in ("dense", "graphs") or (mode == "auto" and device.type == "cuda"):
        compile_mode = "reduce-overhead" if mode == "graphs" else None
        return torch.compile(dense, dynamic=False, mode=compile_mode)  # type: ignore[return-value]
    return dense


def _memory_gb(device: torch.device) -> float:
    """Peak device memory (CUDA) or peak resident memory of this process (CPU), in GB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def _truncate_metrics(path: Path, step: int) -> None:
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


def _fault_injection(rank: int) -> int | None:
    """Test hook: HYBRIDREC_FAULT=<rank>:<step> kills that rank at that step, on the first
    attempt of a torchrun job only (TORCHELASTIC_RESTART_COUNT=0), to prove crash-resume."""
    spec = os.environ.get("HYBRIDREC_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    fault_rank, fault_step = (int(x) for x in spec.split(":"))
    return fault_step if fault_rank == rank else None
