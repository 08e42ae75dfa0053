"""The one way tests compose configs: conf/train.yaml as hybridrec-train composes it.

A plain module (not only a fixture) so that multi-process workers, which import their test
module afresh, can call it too.
"""

from __future__ import annotations

from omegaconf import DictConfig

from hybridrec.config import Config, compose
from hybridrec.configure import validate


def raw_config(*overrides: str) -> DictConfig:
    """The composed, unvalidated config (Hydra's view) for `overrides`."""
    return compose(list(overrides))


def make_config(*overrides: str, world_size: int = 1) -> Config:
    """The validated config for `overrides`, checked for `world_size` ranks."""
    return validate(raw_config(*overrides), world_size=world_size)
