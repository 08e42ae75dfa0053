"""Data sources and loaders. `synthetic` (the default) needs no files."""

from __future__ import annotations

from hybridrec.config import Config
from hybridrec.data.loader import BatchSource, SliceLoader
from hybridrec.data.synthetic import SyntheticCriteo

__all__ = ["BatchSource", "SliceLoader", "SyntheticCriteo", "build_source", "build_loader"]


def build_source(cfg: Config) -> BatchSource:
    """The global-batch source named by `data.name`."""
    if cfg.data.name == "synthetic":
        m = cfg.model
        return SyntheticCriteo(
            m.tables(),
            m.num_dense_features,
            cfg.seed,
            cfg.data.zipf_exponent,
            cfg.data.teacher_scale,
            cfg.data.label_noise,
        )
    raise ValueError(f"data.name={cfg.data.name!r} is not one of: synthetic")


def build_loader(
    cfg: Config,
    source: BatchSource,
    rank: int,
    world_size: int,
    batch_size: int,
    split: str = "train",
    start_step: int = 0,
) -> SliceLoader:
    """This rank's loader over `split`, starting at global batch `start_step`."""
    return SliceLoader(source, rank, world_size, batch_size, split, start_step)
