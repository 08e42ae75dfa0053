"""The config as the command line sees it: composing, override-key checks, model files.

`compose(overrides)` is what `hybridrec-train` composes (conf/train.yaml: the schema's
defaults stored as `base_config`, then the group choices, then the overrides), without
running anything. `check_override_keys` runs before Hydra so that a misspelt key gets the
list of valid keys (Hydra alone says only "not in struct"). `model_file` finds one model
group file the way every command does (hybridrec-train, hybridrec-plan, benchmarks;
`hybridrec.configure.load_model_config` validates it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hybridrec.config.schema import CONF_DIR, DATA_KEYS, Config, fields_at

log = logging.getLogger("hybridrec")

# config groups (`model=...`, `experiment=...`): the directories of conf/
GROUPS = tuple(sorted(p.name for p in CONF_DIR.glob("*") if p.is_dir()))


def register_schema() -> None:
    """Store the schema's defaults in Hydra's ConfigStore as `base_config` (idempotent).

    Stored untyped, as plain values: Hydra composes as with YAML, and `validate` checks keys
    and values against the dataclasses with its own messages (and sees `+key=` additions).
    """
    from hydra.core.config_store import ConfigStore

    node = OmegaConf.to_container(OmegaConf.structured(Config))
    ConfigStore.instance().store(name="base_config", node=node)


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """conf/train.yaml composed with `overrides` (group choices and key=value), unvalidated."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        raw = hydra_compose("train", overrides=list(overrides))
    return resolve_run_length(raw, overrides)


def _given(overrides: Sequence[str]) -> dict[str, str]:
    """The `key=value` pairs of a command line (`+key=` and `++key=` too)."""
    pairs = (a.lstrip("+").split("=", 1) for a in overrides if "=" in a and a[0] not in "-~")
    return {k: v for k, v in pairs}


def resolve_run_length(raw: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """`train.steps` and `train.epochs` both set how long a run is (epochs, when set, decide
    the steps). The one the command line gives wins over the other set by a preset or a
    group file: `experiment=movielens train.steps=20` runs 20 steps (the preset's
    train.epochs is dropped, in one log line). Both on the command line: a ValueError.
    Returns `raw`, changed in place."""
    given = _given(overrides)
    epochs = raw.train.epochs
    if "train.steps" not in given or epochs is None:
        return raw
    if "train.epochs" in given:
        raise ValueError(
            f"train.steps={given['train.steps']} and train.epochs={given['train.epochs']} both "
            "set the run's length; give one (train.epochs sets the steps from the dataset)"
        )
    log.info(
        "train.steps=%s from the command line: the run's length (train.epochs=%s of the "
        "config's preset or group files is dropped)",
        given["train.steps"],
        epochs,
    )
    raw.train.epochs = None
    return raw


def check_override_keys(overrides: list[str]) -> None:
    """Command-line `key=value` overrides must name schema keys (Hydra alone would say only
    "not in struct"); the error lists the keys allowed where the typo is. Group choices
    (`model=...`), Hydra's own keys, additions (`+key=`) and deletions (`~key`) pass through:
    Hydra and validate() check those."""
    for arg in overrides:
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue
        key = arg.split("=", 1)[0]
        if key in GROUPS or key.startswith("hydra") or "@" in key or "/" in key:
            continue
        parts = key.split(".")
        if parts[:2] == ["model", "args"] and not _preset_argument(key, overrides):
            raise ValueError(  # Hydra alone says "not in struct"
                f"{key}: model arguments are added with a plus: +{arg} (or all at once: "
                "'+model.args={name: value, ...}')"
            )
        for i, part in enumerate(parts):
            parent = ".".join(parts[:i])
            allowed = fields_at(parent)
            if not allowed:  # inside a list or dict value: not the schema's to check
                break
            if part not in allowed:
                where = f"under '{parent}'" if parent else "at the top level"
                raise ValueError(f"unknown config key '{key}'; keys {where}: {', '.join(allowed)}")
    _check_data_keys(overrides)


def _preset_argument(key: str, overrides: list[str]) -> bool:
    """Whether model argument `key` (model.args.<name>) is set by a group file the command
    line selects (model=sasrec sets model.args.dropout): then `key=value` overrides it, as
    Hydra takes it, and a plus would be refused. Hydra's flags and own keys (a rank's
    `--config-path=`, `hydra.run.dir=`: the launcher passes them) are not composed."""
    others = [
        a
        for a in overrides
        if not a.startswith("-")
        and not a.lstrip("+~").startswith("hydra.")
        and a.split("=", 1)[0].lstrip("+~").split(".")[:2] != ["model", "args"]
    ]
    try:
        args = compose(others).model.get("args") or {}
    except Exception:  # noqa: BLE001 - the command line's own error is Hydra's to report
        return False
    return key.split(".", 2)[2].split(".")[0] in args


def _check_data_keys(overrides: list[str]) -> None:
    """A `data.<key>` the schema knows but the chosen dataset does not read (`data.path` with
    the default synthetic data): name the datasets that read it (schema.DATA_KEYS). The
    dataset is the one the group choices given (experiments included) compose to."""
    keys = [a.split("=", 1)[0] for a in overrides if a.startswith("data.") and "=" in a]
    if not keys:
        return
    choices = [a for a in overrides if "=" in a and a.split("=", 1)[0] in GROUPS]
    try:
        name = compose(choices).data.name
    except Exception:  # noqa: BLE001 - a sweep's "a,b" or a bad choice: Hydra reports those
        return
    own = DATA_KEYS.get(name)
    if own is None:  # not a known source: validate() names the choices
        return
    for key in keys:
        part = key.split(".")[1]
        if part in own:
            continue
        has = [source for source in sorted(DATA_KEYS) if part in DATA_KEYS[source]]
        hint = f"; choose a dataset that has it, e.g. data={has[0]} {key}=..." if has else ""
        raise ValueError(
            f"'{key}' is not a key of data={name}{hint} (keys of data={name}: {', '.join(own)})"
        )


def model_file(name_or_path: str) -> DictConfig:
    """A model group file (`conf/model/<name>.yaml` or a path), as written (unvalidated)."""
    path = Path(name_or_path)
    if not path.suffix:
        path = CONF_DIR / "model" / f"{name_or_path}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        raise ValueError(
            f"model {name_or_path!r} not found ({path}); choices: {', '.join(choices)}"
        )
    node = OmegaConf.load(path)
    if not isinstance(node, DictConfig):
        raise ValueError(f"{path}: a model file holds `key: value` lines, not a list")
    return node
