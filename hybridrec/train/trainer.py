"""The training loop: one global batch per step, split evenly over ranks.

A step (`train_step`) reads: learning-rate schedule, forward (embeddings, then the dense part,
under bf16 autocast on GPU), loss, the pipeline's look-ahead (hybridrec.train.pipeline),
backward (which also updates the embedding rows: hybridrec.sparse.fused) and the dense
optimizer step. `fit` runs steps and after each, when due (hybridrec.train.cadence), logs
(rank 0), saves and resumes (hybridrec.train.resume), evaluates (hybridrec.train.evaluator),
and stops on request (hybridrec.train.preemption) or at `eval.target_auc` / `target_rmse`;
with `eval.final_split` it then scores that whole split once (the last metrics row). The loss
and the top-K and next-item evaluations are model.task's (hybridrec.train.objective). The
trainer reaches embedding modules only through hybridrec.sparse.api.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from hybridrec import timing
from hybridrec.builder import build
from hybridrec.config import Config
from hybridrec.data import build_loader, build_source
from hybridrec.data.build import steps_for_epochs, warn_many_epochs
from hybridrec.distributed import failure
from hybridrec.distributed.comm import all_reduce_sum, any_rank
from hybridrec.distributed.env import DistEnv
from hybridrec.model.task import task_outputs
from hybridrec.optim import LRSchedule, build_dense_optimizer
from hybridrec.shard import declarations
from hybridrec.sparse.api import EmbeddingModule, IdCounts, embedding_modules
from hybridrec.timing import PhaseTimer
from hybridrec.train import console
from hybridrec.train.cadence import Cadence, Window
from hybridrec.train.checkpoint import CheckpointError, check_writable, checkpoint_step
from hybridrec.train.dense_check import DenseChecker, dataset_locator, dense_names
from hybridrec.train.evaluator import evaluate
from hybridrec.train.exact import ExactTraining
from hybridrec.train.health import NonFiniteWatch
from hybridrec.train.loggers import NullLogger, truncate_metrics
from hybridrec.train.metrics import reached_target
from hybridrec.train.objective import Objective
from hybridrec.train.pipeline import TrainPipeline, staged_step, warm_start
from hybridrec.train.preemption import PreemptionGuard, fault_injection
from hybridrec.train.profile import STEP, StepProfiler
from hybridrec.train.resume import Checkpointer, check_resume
from hybridrec.train.topk import TopKLists, evaluate_retrieval
from hybridrec.types import Batch, KeyedIds

log = logging.getLogger("hybridrec")


class Trainer:
    """Owns the model, its optimizers and the data stream for one run."""

    def __init__(self, cfg: Config, env: DistEnv, run_dir: Path | None = None) -> None:
        self.cfg, self.env = cfg, env
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.source = build_source(cfg)
        if cfg.train.epochs is not None:
            cfg.train.steps = steps_for_epochs(cfg.train.epochs, self.source, cfg.train.batch_size)
        elif env.is_main and not cfg.eval.only:
            warn_many_epochs(cfg.train.steps, self.source, cfg.train.batch_size)
        check_resume(cfg)  # a checkpoint of another model is refused before any allocation
        self.model, self.plan = build(cfg, env)  # any model, sharded by hybridrec.parallelize
        self.dense_opt = build_dense_optimizer(self.model.parameters(), cfg.optim.dense, env.device)
        self.schedule = LRSchedule(cfg.optim.schedule, cfg.optim.dense.lr, cfg.optim.sparse.lr)
        # the batch's id columns are the dataset's features, in order; each declaration of
        # tables reads its own features from them by name
        self.features = cfg.model.tables()
        self.tables = {id(t.storage): t for t in declarations(self.model)}
        self.embeddings = embedding_modules(self.model)
        opts = [opt for m in self.embeddings for opt in m.sparse_optimizers()]
        self._sparse_opts = list({id(o): o for o in opts}.values())  # each shared one once
        self.lr = (cfg.optim.dense.lr, cfg.optim.sparse.lr)  # (dense, sparse) of the last step
        # the loss (model.task's or the model's own; a mean over this rank's slice), and for
        # retrieval the forward's negatives and the dataset's interactions
        self.objective = Objective(cfg, env, self.model, self.source, self.features)
        exact, own_loss = cfg.train.exact, self.objective.own_loss
        self.exact = ExactTraining(cfg, env, self.model, self.keyed, own_loss) if exact else None
        self._stage_step = 0  # the training step whose batch the pipeline stages
        self.local_batch = cfg.train.batch_size // env.world_size
        cuda = env.device.type == "cuda"
        self.autocast = torch.autocast(
            device_type=env.device.type,
            dtype=torch.bfloat16,
            enabled=cuda and cfg.train.autocast == "bf16",
        )
        self.checkpoints = Checkpointer(cfg, env, self.model, self.dense_opt, self.plan)
        self.resume_from = self.checkpoints.resume_from
        # train.count_from=resume: the run's length and its training batches count from here
        self.first = self.checkpoints.start
        cfg.train.steps += self.first
        # rows logged after the resumed checkpoint (by a run that crashed) are logged again
        if self.resume_from is not None and env.is_main and self.run_dir is not None:
            truncate_metrics(self.run_dir / "metrics.jsonl", checkpoint_step(self.resume_from))
        # a resumed run continues its W&B run, not a new one
        wandb_run_id = self.checkpoints.saved_extra().get("wandb_run_id") if env.is_main else None
        self.logger = (
            console.build_loggers(cfg, env, self.run_dir, wandb_run_id)
            if self.run_dir
            else NullLogger()
        )
        self.history: list[dict[str, Any]] = []
        self.timer = PhaseTimer(env.device)  # active during steps (hybridrec.timing.active)
        self.step = 0  # optimizer steps done
        self.skipped = 0  # steps dropped by train.nonfinite=skip
        self.nonfinite = NonFiniteWatch(env, inputs_checked=cfg.train.check_ids)
        # NaN or inf dense features are bad input, checked like the ids (train.check_ids)
        names = dense_names(self.source)
        self.dense_checks = (
            {split: DenseChecker(env, names, split) for split in ("train", "eval")}
            if cfg.train.check_ids
            else {}
        )

    def keyed(self, ids: torch.Tensor) -> KeyedIds:
        """A batch's ids [B, H] by feature: the dataset's features, in order."""
        return KeyedIds(ids, [f.name for f in self.features], [f.hotness for f in self.features])

    def score(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The model's raw outputs [B] fp32 for dense [B, F] and ids [B, H] (its forward)."""
        return task_outputs(self.model(dense, self.keyed(ids)))

    def module_ids(self, module: EmbeddingModule, ids: torch.Tensor) -> torch.Tensor:
        """The ids embedding `module` looks up for the batch of ids [B, H] being staged (its
        columns; Objective.stage_ids)."""
        return self.objective.stage_ids(self.tables[id(module)], self.keyed(ids), self._stage_step)

    def module_counts(self, module: EmbeddingModule, counts: IdCounts) -> IdCounts:
        """The data's id counts by the dataset's feature index, as `module` indexes them."""
        index = {f.name: i for i, f in enumerate(self.features)}
        where = [index[name] for name in self.tables[id(module)].feature_names]
        return lambda f: counts(where[f])

    def warm_start_caches(self) -> int:
        """Fill host caches from the data's id counts; returns the rows loaded here."""
        counts = self.source.id_counts  # None per table where the data records none
        return warm_start(self.embeddings, counts, self.cfg.train.batch_size, self.module_counts)

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
    def pipeline(self, batches: Iterator[Batch]) -> TrainPipeline:
        """Look-ahead over `batches` for this model's embedding modules (see TrainPipeline)."""
        return TrainPipeline(batches, self.env.device, self.embeddings, self.module_ids)

    def train_batches(
        self, batches: Sequence[Batch], look_ahead: bool = True
    ) -> list[torch.Tensor]:
        """Train on `batches` in order; returns the local losses. With `look_ahead`, through a
        pipeline as fit() trains (tests and benchmarks bring their own batches)."""
        pipe = self.pipeline(iter(batches)) if look_ahead else None
        losses = []
        for s, batch in enumerate(batches):
            more = pipe is not None and staged_step(s + 1) <= len(batches)
            losses.append(self.train_step(pipe.next() if pipe else batch, pipe if more else None))
        if pipe is not None:
            pipe.close()
        return losses

    def train_step(self, batch: Batch, pipeline: TrainPipeline | None = None) -> torch.Tensor:
        """One optimizer step on this rank's batch (counted in `self.step`, which sets the
        learning-rate schedule); returns the local mean loss (no sync). With a `pipeline`,
        the next batch is staged between the forward and the backward (pipeline.prefetch_next)."""
        failure.set_position(f"training step {self.step + 1}")  # named by a failed collective
        with timing.active(self.timer), self.timer.region(STEP):
            self.model.train()
            if self.schedule.enabled:  # the sparse rate must be set before the backward uses it
                self.lr = self.schedule.apply(self.step + 1, self.dense_opt, self._sparse_opts)
            batch = batch.to(self.env.device, non_blocking=True)
            dense = batch.dense
            if self.dense_checks:
                dense = self.dense_checks["train"](dense, self.step, self.env.rank * batch.size)
            keyed, extra = self.keyed(batch.ids), self.objective.forward_kwargs(self.step + 1)
            # DDP's own forward collective (its bucket rebuild, in step 2) is named too
            with timing.phase("forward"), self.autocast, self._ddp_exchange("DDP forward"):
                if self.exact is None:
                    outputs = self.model(dense, keyed, **extra)
                else:  # the global batch's outputs, batch and ids (hybridrec.exact)
                    outputs, batch, keyed = self.exact.forward(dense, batch, keyed, extra)
            loss = self.objective.loss(outputs, batch, keyed, extra)
            if pipeline is not None:
                self._stage_step = staged_step(self.step + 1)  # this step is self.step + 1
                pipeline.prefetch_next()
            self.dense_opt.zero_grad(set_to_none=True)
            if self.cfg.train.nonfinite == "skip" and not self.nonfinite.all_finite(loss):
                self.check_inputs()  # bad input is an error, not a step to skip (collective)
                self.skipped += 1
                self.step += 1
                log.warning(
                    "non-finite loss at step %d: update skipped (%d so far)",
                    self.step,
                    self.skipped,
                )
                return loss.detach()
            with timing.phase("backward"), self._ddp_exchange("dense_grads (DDP all-reduce)"):
                # also applies the sparse optimizer to the touched embedding rows
                loss.backward() if self.exact is None else self.exact.backward(loss)
            with timing.phase("dense_optimizer"):
                self.dense_opt.step()
            self.nonfinite.note(loss, self.step + 1)
            self.step += 1
            return loss.detach()

    def _ddp_exchange(self, name: str) -> contextlib.AbstractContextManager:
        """The model's own collectives are named where they run; what fails outside them is
        DDP's (its gradient all-reduce inside the autograd engine, its bucket rebuild at the
        start of the second forward): named `name`."""
        group = self.env.group
        return contextlib.nullcontext() if group is None else failure.exchange(name, group)

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank (a collective: every rank calls it)."""
        group = self.env.group
        return flag if group is None else any_rank(flag, group, self.env.device, "stop_signal")

    def check_inputs(self) -> None:
        """Raise if a deferred id check (CUDA, see hybridrec.sparse.ids.IdChecker) met
        an out-of-range id, or a dense check (hybridrec.train.dense_check) a NaN or inf
        feature, since the last call; collective on several ranks."""
        for module in self.embeddings:
            module.check_inputs()
        for check in self.dense_checks.values():
            check.raise_recorded()

    def check_finite(self) -> None:
        self.nonfinite.check()

    def global_mean(self, value: torch.Tensor) -> float:
        """Mean of a per-rank scalar over ranks (ranks hold equal batch slices); exact mode's
        loss is the global batch's already, on every rank."""
        if self.env.group is not None and self.exact is None:
            value = all_reduce_sum(value.clone(), self.env.group, name="loss_mean")
            value /= self.env.world_size
        return float(value)

    def evaluate(self, split: str = "eval", whole: bool = False) -> dict[str, float]:
        """Exact metrics over `eval.batches` global batches of `split` (eval: data.eval_split),
        or the whole split (None, or `whole`); the same on every rank and for any world size
        (hybridrec.train.evaluator)."""
        with timing.active(self.timer), failure.at(f"evaluation after step {self.step}"):
            self.model.eval()
            for m in self.embeddings:  # count this evaluation's lookups only
                m.take_eval_unknown()
            if self.objective.interactions is not None:
                metrics = self.evaluate_topk(split, whole)[0]
            elif self.objective.next_item is not None:
                name = self.cfg.data.eval_split if split == "eval" else split
                metrics = self.objective.evaluate_next_item(
                    name, self.keyed, whole, self._eval_chunk()
                )
            else:
                metrics = evaluate(
                    self.score, self.loader(split), self.env, self.cfg.eval.batch_size,
                    None if whole else self.cfg.eval.batches, self.source.split_rows(split),
                    self.autocast, self.check_inputs, self.cfg.model.task,
                    chunk=self._eval_chunk(), check_dense=self.dense_checks.get("eval"),
                )  # fmt: skip
            # dynamic tables: the share of this evaluation's ids that had no row
            taken = [m.take_eval_unknown() for m in self.embeddings]
            unknown = console.summed_counters(taken, self.env)
            if not metrics:  # an empty split: no row (the source warned), with or without them
                return {}
            return {**metrics, **console.unknown_rates(unknown.dynamic)}

    def evaluate_topk(
        self, split: str = "eval", whole: bool = False, lists: bool = False
    ) -> tuple[dict[str, float], TopKLists | None]:
        """model.task=retrieval: HR@K, Recall@K, NDCG@K (eval.topk) over the whole catalogue
        (hybridrec.train.topk), and with `lists` each user's top-K; in eval mode."""
        self.model.eval()
        name = self.cfg.data.eval_split if split == "eval" else split
        run = self.objective.catalogue_eval(name, self.env, self._eval_chunk())
        batches = None if whole else self.cfg.eval.batches
        return evaluate_retrieval(
            run, self.loader(split), self.keyed, self.cfg.eval, batches, self.autocast,
            self.check_inputs, self._eval_chunk(), lists,
        )  # fmt: skip

    def _eval_chunk(self) -> int | None:
        """Samples per lookup in evaluation: host caches hold one training batch's rows; exact
        mode's micro-shards (ExactTraining.eval_chunk)."""
        if self.exact is not None:
            return self.exact.eval_chunk
        return self.local_batch if any(m.prefetches for m in self.embeddings) else None

    # -- checkpoints ----------------------------------------------------------------------
    def restore(self) -> None:
        """Resume from a checkpoint (checkpoint.resume) or warm-start (model.init_from)."""
        self.step, self.skipped = self.checkpoints.restore()

    def evaluate_only(self) -> dict[str, Any]:
        """eval.only: load the checkpoint (or model.init_from), evaluate, log one eval row."""
        self.restore()
        if self.resume_from is None and not self.cfg.model.init_from:
            raise CheckpointError(
                f"eval.only: no complete checkpoint under checkpoint.dir={self.cfg.checkpoint.dir}"
                " to evaluate (checkpoint.resume=never, or none saved yet)"
            )
        metrics = self._eval_row(self.step)
        self.logger.close()
        return {"train": {}, "eval": metrics}

    def save(self) -> Path | None:
        """A checkpoint at this step, when checkpoint.dir is set; never of poisoned weights."""
        if not self.cfg.checkpoint.dir:
            return None
        with failure.at(f"checkpoint save after step {self.step}"):
            self.check_inputs()
            self.check_finite()
            return self.checkpoints.save(self.step, self.skipped, self.logger.run_id)

    # -- loop -------------------------------------------------------------------------------
    def _record(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        self.logger.log(row)

    def _log_train(self, loss: torch.Tensor, steps_since: int, seconds: float) -> dict[str, Any]:
        mean_loss = self.global_mean(loss)
        self.check_inputs()
        self.check_finite()
        row: dict[str, Any] = {
            "step": self.step,
            "split": "train",
            "loss": mean_loss,
            "samples_per_sec": steps_since * self.cfg.train.batch_size / seconds,
            **console.phase_columns(self.timer.report(steps_since)),
            "mem_gb": console.memory_gb(self.env.device),
        }
        if self.schedule.enabled:
            row["lr/dense"], row["lr/sparse"] = self.lr
        if self.skipped:
            row["skipped_steps"] = self.skipped
        taken = [m.take_metrics() for m in self.embeddings]
        return row | console.embedding_rates(taken, self.env, steps_since)

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
                console.plan_rows(self.plan),
            )
        bar = console.progress_bar(cfg, env)
        stack = contextlib.ExitStack()
        if bar is not None:
            bar.update(self.step)
            # log lines go above the bar (tqdm.write), not onto the end of its line
            stack.enter_context(logging_redirect_tqdm())
        console.show_start(cfg, env, self.step, self.local_batch)
        if any(m.prefetches for m in self.embeddings):
            self.warm_start_caches()
        pipeline = self.pipeline(self.loader("train", self.step - self.first))
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
        for split, check in self.dense_checks.items():  # the loader's batches: rows are known
            size = cfg.train.batch_size if split == "train" else cfg.eval.batch_size
            offset = self.first if split == "train" else 0
            check.locate = dataset_locator(self.source, size, split, offset)
        first, start = self.step, time.perf_counter()
        with PreemptionGuard(enabled=bool(cfg.checkpoint.dir)) as guard:
            try:
                result = self._run_steps(pipeline, bar, profiler, guard)
            finally:
                pipeline.close()
                if profiler is not None:
                    profiler.close()
                if bar is not None:
                    bar.close()
                stack.close()
                for check in self.dense_checks.values():
                    check.locate = None
        self.logger.close()
        if env.is_main and self.step > first:
            wall_s = time.perf_counter() - start
            console.show_summary(cfg, result, self.step - first, wall_s, self.run_dir)
        return result

    def _run_steps(
        self,
        pipeline: TrainPipeline,
        bar: tqdm | None,
        profiler: StepProfiler | None,
        guard: PreemptionGuard,
    ) -> dict[str, Any]:
        """fit()'s loop: a training step, then what is due after it (hybridrec.train.cadence:
        log, save, evaluate, stop); after the last step, eval.final_split's evaluation."""
        cfg, env, steps = self.cfg, self.env, self.cfg.train.steps
        cadence, window = Cadence.of(cfg), Window(self.step)
        fault = fault_injection(env.rank)
        result: dict[str, Any] = {"train": {}, "eval": {}, "preempted": False}
        self.timer.report(1)  # drop anything timed before the loop
        while self.step < steps:
            more = staged_step(self.step + 1) <= steps  # no batch staged past the last step
            loss = self.train_step(pipeline.next(), pipeline if more else None)
            step = self.step
            if profiler is not None:
                profiler.after_step(step)
            if fault is not None and step == fault:
                log.warning("rank %d: fault injection at step %d (HYBRIDREC_FAULT)", env.rank, step)
                os.kill(os.getpid(), signal.SIGKILL)
            due = cadence.after(step, steps)
            if due.log:
                result["train"] = self._log_row(loss, window, bar)
                if cfg.checkpoint.dir and guard.agreed(self._any_rank, step):
                    due, result["preempted"] = due.on_stop_signal(), True
            if due.save:
                self.save()  # before evaluating: an error there cannot cost the training
            if due.evaluate:
                result["eval"] = self._eval_row(step)
                reached = reached_target(cfg.eval, result["eval"])
                if reached:
                    log.info("reached %s at step %d: stopping", reached, step)
                    if not due.save:
                        self.save()
                    due = due.on_target()
            if due.restarts_window:
                self.timer.report(1)
                window.restart(step)  # eval/save time is not throughput
            if bar is not None:
                bar.update(1)
            if due.stop:
                break
        split = cfg.eval.final_split
        if split is not None and not result["preempted"]:  # the whole split, once, as the last row
            if "eval" in self.dense_checks:  # a NaN feature names its row in this split
                locate = dataset_locator(self.source, cfg.eval.batch_size, split)
                self.dense_checks["eval"].locate = locate
            result["final"] = self._eval_row(self.step, split)
        return result

    def _log_row(self, loss: torch.Tensor, window: Window, bar: tqdm | None) -> dict[str, Any]:
        """Log (and show) the train row of this step: rates over `window`, then restarted."""
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)
        row = self._log_train(loss, *window.span(self.step))
        self._record(row)
        # every rate in a row covers the steps since the previous row: the phase timer and
        # cache counters reset when read, so the step count and clock restart too
        window.restart(self.step)
        console.show_train(row, self.cfg.train.steps, bar)
        return row

    def _eval_row(self, step: int, split: str | None = None) -> dict[str, float]:
        """Evaluate (eval.batches of the eval split, or the whole `split`) and log its row,
        named by the dataset split it scored (val or test)."""
        metrics = self.evaluate() if split is None else self.evaluate(split, whole=True)
        if metrics:
            name = split or self.cfg.data.eval_split
            self._record({"step": step, "split": name, **metrics})
            console.show_eval(step, metrics, name)
        return metrics
