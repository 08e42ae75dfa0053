"""Config -> data source and per-rank loader (what the trainer calls).

- data.name: `synthetic` (default, no files), `criteo` (a directory made by
  hybridrec-preprocess, data.path), `criteo_sample` (200 real rows, the file data.path or
  $HYBRIDREC_CRITEO_SAMPLE names, preprocessed into a cache on first use), `table` (a
  directory made by hybridrec-preprocess --spec from your own table, data.path; the model's
  tables follow it, hybridrec.data.table_model); see hybridrec.data.source. `sequences`
  (users' item sequences for next-item models, data.path a `user item` file or an
  interaction table: hybridrec.data.sequence_source).
- data.loader: `per_rank` (every rank reads its own slice) or `broadcast` (rank 0 reads,
  broadcasts, every rank keeps its slice); both read `data.prefetch` batches ahead.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from hybridrec.data.loader import BatchSource, SliceLoader
from hybridrec.data.synthetic import SyntheticCriteo

if TYPE_CHECKING:
    from hybridrec.config import Config

log = logging.getLogger("hybridrec")

# data.name: the sources build_source makes
SOURCES = ("synthetic", "criteo", "criteo_sample", "table", "sequences")


def build_source(cfg: Config) -> BatchSource:
    """The global-batch source named by `data.name` (file sources checked against the model)."""
    d = cfg.data
    if d.name == "synthetic":
        ignored = [
            f"data.{k}={getattr(d, k)!r}"
            for k, default in (("reader", "memmap"), ("path", None), ("cache_dir", None))
            if getattr(d, k) != default
        ]
        if ignored:
            log.warning("%s: no effect with data.name=synthetic", ", ".join(ignored))
        m = cfg.model
        return SyntheticCriteo(
            m.tables(),
            m.num_dense_features,
            cfg.seed,
            d.zipf_exponent,
            d.teacher_scale,
            d.label_noise,
        )
    if d.name in ("criteo", "criteo_sample", "table"):
        from hybridrec.data.source import open_source

        return open_source(cfg)
    if d.name == "sequences":
        from hybridrec.data.sequence_source import SequenceSource, read_sequences

        nxt = cfg.train.next_item
        negatives = nxt.negatives if nxt.loss == "bce" else 0
        return SequenceSource(read_sequences(d), d.sequence.max_len, negatives, cfg.seed)
    raise ValueError(f"data.name={d.name!r} is not one of: {', '.join(SOURCES)}")


def build_loader(
    cfg: Config,
    source: BatchSource,
    rank: int,
    world_size: int,
    batch_size: int,
    split: str = "train",
    start_step: int = 0,
    group=None,  # noqa: ANN001 - a torch.distributed ProcessGroup (imported lazily)
):  # noqa: ANN201 - SliceLoader | BroadcastLoader
    """This rank's loader over `split`, starting at global batch `start_step`.

    `group` is the process group the broadcast loader uses (the default group when None and
    several ranks run).
    """
    d = cfg.data
    if d.loader == "broadcast":
        from hybridrec.data.broadcast import BroadcastLoader

        if group is None and world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                group = dist.group.WORLD
        return BroadcastLoader(
            source, rank, world_size, batch_size, split, start_step, group, d.prefetch
        )
    return SliceLoader(source, rank, world_size, batch_size, split, start_step, d.prefetch)


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


def warn_many_epochs(steps: int, source: BatchSource, batch_size: int, limit: float = 10) -> None:
    """A finite training split that `train.steps` would go over more than `limit` times gets
    a warning: `data=criteo_sample` with the default steps is 480 epochs of 160 rows."""
    per_epoch = source.steps_per_epoch(batch_size, "train")
    if per_epoch and steps / per_epoch > limit:
        log.warning(
            "train.steps=%d is %.0f epochs of the training split (%d steps of %d samples each): "
            "set train.epochs=1 (or a few) to train on each row once",
            steps,
            steps / per_epoch,
            per_epoch,
            batch_size,
        )
