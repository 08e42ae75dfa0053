"""A run's checkpoints as the trainer uses them: which one a resume loads, restoring it (or
warm-starting from `model.init_from`), and saving with what the next resume checks.

Which checkpoint a resume will load is known at start, so metric rows logged after it (by a
run that crashed) can be dropped before the loggers open the file, and a resumed run keeps
its W&B run. The training stream (`stream`) is saved too: resuming with other values that
decide which samples global batch k holds is allowed, with a warning naming them.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridrec.builder import model_features
from hybridrec.config import Config
from hybridrec.data.dense_stats import dataset_fingerprint, differences, read_dense_stats
from hybridrec.distributed.env import DistEnv
from hybridrec.model.tables import declared_features
from hybridrec.train.checkpoint import (
    CorruptCheckpointError,
    TrainState,
    check_matches,
    checkpoint_step,
    init_from_export,
    intact_before,
    load_checkpoint,
    model_signature,
    read_manifest,
    resolve_resume,
    save_checkpoint,
)
from hybridrec.train.checkpoint.dynamic import KeyName, library_key, policy_changes
from hybridrec.train.checkpoint.format import dense_module
from hybridrec.types import ShardingPlan

log = logging.getLogger("hybridrec")


def stream(cfg: Config) -> dict[str, Any]:
    """What decides which samples global batch k holds."""
    d = cfg.data
    out: dict[str, Any] = {
        "train.batch_size": cfg.train.batch_size,
        "seed": cfg.seed,
        "data.name": d.name,
        "data.path": d.path,
        "data.shuffle": d.shuffle,
        "data.last_batch": d.last_batch,
        "data.zipf_exponent": d.zipf_exponent,
        "data.teacher_scale": d.teacher_scale,
        "data.label_noise": d.label_noise,
    }
    if d.name == "sequences":  # also how the file numbers items, which exports record
        out["data.sequence"] = dataclasses.asdict(d.sequence)
    return out


def dynamic_key(cfg: Config) -> KeyName:
    """How this run's config sets a dynamic table's key (checkpoint.dynamic.policy_refusal's
    `key_name`): `model.dynamic.<table>.<key>` and the table's rows (data=table: filled from
    the dataset spec's policy and capacity, named too); a table a model class declares
    itself: its Table / Dynamic arguments."""
    m, spec = cfg.model, cfg.data.name == "table"

    def name(table: str, key: str) -> str:
        base = table.rsplit(".", 1)[-1]  # checkpoints name tables "<namespace>.<table>"
        if base not in (m.dynamic or {}) and m.built_by_class():
            return library_key(table, key)
        if key == "capacity":
            return f"model.num_embeddings_per_feature of table {base}" + (
                " (the spec's capacity)" if spec else ""
            )
        if key == "dynamic":
            return f"model.dynamic.{base}" + (" (the spec's encoding: dynamic)" if spec else "")
        return f"model.dynamic.{base}.{key}" + (f" (the spec's policy.{key})" if spec else "")

    return name


def check_resume(cfg: Config) -> None:
    """Before the model is built: the checkpoint a resume would load holds this model's
    tables and optimizers, and its dynamic tables' maps fit their policies (a mismatch
    otherwise shows only after every table is allocated)."""
    path = resolve_resume(cfg.checkpoint.dir, cfg.checkpoint.resume)
    if path is not None:
        check_matches(
            path,
            model_features(cfg),
            cfg.optim.sparse.name,
            cfg.optim.dense.name,
            dynamic_key(cfg),
            "checkpoint.resume=never, or another checkpoint.dir",
        )


class Checkpointer:
    """Checkpoints of one run (`checkpoint.*`), for this rank's model and dense optimizer."""

    def __init__(
        self,
        cfg: Config,
        env: DistEnv,
        model: nn.Module,
        dense_opt: torch.optim.Optimizer,
        plan: ShardingPlan | None,
    ) -> None:
        self.cfg, self.env, self.model, self.dense_opt, self.plan = cfg, env, model, dense_opt, plan
        self.resume_from = resolve_resume(cfg.checkpoint.dir, cfg.checkpoint.resume)
        self.tables = declared_features(dense_module(model))  # as checkpoints name them
        self.signature = model_signature(
            self.tables, model, cfg.optim.sparse.name, cfg.optim.dense.name
        )
        # the training data: its fingerprint (which run a checkpoint continues) and what
        # standardize applied to it (saved, and compared on resume)
        table = cfg.data.name == "table" and cfg.data.path
        self.data_id = dataset_fingerprint(cfg.data.path) if cfg.data.path else None
        self.dense_stats = read_dense_stats(cfg.data.path) if table else None
        # the step this run's length and training data count from (train.count_from)
        self.start = self._count_start() if cfg.train.count_from == "resume" else 0

    def _count_start(self) -> int:
        """train.count_from=resume: 0 without a checkpoint, else the resumed step; but a
        checkpoint saved by a run on this very training stream and dataset (its fingerprint:
        a new day's data at the same path is another) continues that run: the step it
        counted from, so it ends where it would have (after a crash or a stop, the day's pass
        still trains once; after it finished, the same command trains nothing more)."""
        if self.resume_from is None:
            return 0
        extra = self.saved_extra()
        step = checkpoint_step(self.resume_from)
        run = extra.get("run")
        same = extra.get("stream") == stream(self.cfg)
        if same and isinstance(run, dict) and run.get("data") == self.data_id:
            if run.get("from", step + 1) <= step <= run.get("to", -1):
                return int(run["from"])
        return step

    def saved_extra(self) -> dict[str, Any]:
        """The `extra` of the checkpoint a resume will load ({} when none)."""
        if self.resume_from is None:
            return {}
        return read_manifest(self.resume_from, verify=False).get("extra", {})

    def restore(self) -> tuple[int, int]:
        """Load the resume checkpoint, or model.init_from; returns (step, skipped steps)."""
        ck, path = self.cfg.checkpoint, self.resume_from
        if path is None:
            if self.cfg.model.init_from:
                init_from_export(Path(self.cfg.model.init_from), self.model, self.tables)
                log.info("initialised weights from %s", self.cfg.model.init_from)
            return 0, 0
        try:
            state = load_checkpoint(path, self.model, self.dense_opt, self.signature, ck.verify)
        except CorruptCheckpointError as e:
            older = intact_before(path)
            if not older:
                raise
            names = ", ".join(p.name for p in older[:3]) + (" ..." if len(older) > 3 else "")
            raise CorruptCheckpointError(
                f"{e}; older intact checkpoints: {names}: resume from the newest with "
                f"checkpoint.resume={older[0]} (or move {path} away)"
            ) from None
        log.info("resumed from %s at step %d", path, state.step)
        self._check_dense_stats(state.extra)
        if self.cfg.train.count_from == "resume" and self.env.is_main and not self.cfg.eval.only:
            log.info(
                "train.count_from=resume: steps %d..%d, the training data from its batch %d "
                "(counted from step %d)",
                state.step + 1,
                self.cfg.train.steps,
                state.step - self.start,
                self.start,
            )
            self._check_eps_form(state.extra)  # another stream is this key's purpose: no warning
            return state.step, int(state.extra.get("skipped", 0))
        saved = state.extra.get("stream")
        changed = [
            f"{k} {saved[k]!r} -> {v!r}"
            for k, v in stream(self.cfg).items()
            if saved is not None and k in saved and saved[k] != v
        ]
        if changed and self.env.is_main and not self.cfg.eval.only:  # eval.only: no stream
            log.warning(
                "resuming with a different training stream (%s): training continues at "
                "global batch %d of the new stream, not where the saved run stopped, so "
                "the result will differ from an uninterrupted run",
                "; ".join(changed),
                state.step,
            )
        self._check_eps_form(state.extra)
        changes = policy_changes(read_manifest(path, verify=False), self.signature["tables"])
        if changes and self.env.is_main and not self.cfg.eval.only:
            log.warning(
                "resuming dynamic tables under other policy values (%s): their maps decide by "
                "the new values from step %d on, so the result will differ from an "
                "uninterrupted run",
                "; ".join(changes),
                state.step,
            )
        return state.step, int(state.extra.get("skipped", 0))

    def _check_dense_stats(self, extra: dict[str, Any]) -> None:
        """Warn when this data's dense columns are standardized with other statistics than
        the checkpoint's training data (each day's own, say): the same raw value then reaches
        the model as another input."""
        saved = extra.get("dense_stats")
        if saved is None or self.dense_stats is None or not self.env.is_main:
            return
        diffs = differences(saved, self.dense_stats)
        if diffs:
            was = (extra.get("stream") or {}).get("data.path") or "the checkpoint's dataset"
            log.warning(
                "%s is standardized with other statistics than the checkpoint's training data "
                "(%s): the model sees other inputs for the same raw values; preprocess it with "
                "--stats-from %s (docs/dynamic.md, Day by day)",
                self.cfg.data.path,
                "; ".join(diffs),
                was,
            )

    def _check_eps_form(self, extra: dict[str, Any]) -> None:
        """Warn when sparse Adam resumes under another eps form than it was saved with. The
        form is a setting, not state, so the config's wins; a checkpoint without the entry
        was written before `optim.sparse.eps_form` existed, in SparseAdam's form."""
        sparse = self.cfg.optim.sparse
        if sparse.name != "adam" or not self.env.is_main or self.cfg.eval.only:
            return
        saved = extra.get("sparse_eps_form", "sparse_adam")
        if saved != sparse.eps_form:
            before = "" if "sparse_eps_form" in extra else " (written before the key existed)"
            log.warning(
                "resuming sparse adam saved with optim.sparse.eps_form=%s%s under "
                "optim.sparse.eps_form=%s: the rest of the run adds eps in the new form, so "
                "it differs from an uninterrupted run; set optim.sparse.eps_form=%s to keep it",
                saved,
                before,
                sparse.eps_form,
                saved,
            )

    def save(self, step: int, skipped: int, wandb_run_id: str | None) -> Path | None:
        """Save at `step` (None when checkpoint.dir is unset)."""
        ck = self.cfg.checkpoint
        if not ck.dir:
            return None
        extra: dict[str, Any] = {
            "skipped": skipped,
            "stream": stream(self.cfg),
            "model": dataclasses.asdict(self.cfg.model),  # for hybridrec.model.load_export
            # train.count_from: where this run counted from and ends, on which data
            "run": {"from": self.start, "to": self.cfg.train.steps, "data": self.data_id},
        }
        if self.dense_stats is not None:  # hybridrec.data.dense_stats
            extra["dense_stats"] = self.dense_stats
        if self.cfg.optim.sparse.name == "adam":  # what the next resume compares its form with
            extra["sparse_eps_form"] = self.cfg.optim.sparse.eps_form
        if wandb_run_id:
            extra["wandb_run_id"] = wandb_run_id
        state = TrainState(step, step, extra)
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
