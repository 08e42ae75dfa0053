"""Config composition (real Hydra) and validation: every mistake names its key."""

from __future__ import annotations

import pytest

from hybridrec.config import CONF_DIR
from hybridrec.configure import load_model_config, validate
from tests.configs import raw_config as _compose


def test_default_config_validates():
    cfg = validate(_compose())
    assert cfg.model.name == "dlrm_tiny" and cfg.sharding.type == "none"
    assert cfg.data.name == "synthetic" and cfg.logger.name == "none"


@pytest.mark.parametrize(
    "name", ["dlrm_tiny", "dlrm_kaggle", "dlrm_1tb", "dcnv2_1tb", "dlrm_1tb_uncapped"]
)
def test_model_configs(name):
    m = load_model_config(name)
    tables = m.tables()
    assert len(tables) == len(m.num_embeddings_per_feature)
    if name == "dlrm_kaggle":
        assert len(tables) == 26 and sum(t.num_rows for t in tables) == 33_762_577
        assert m.bottom_mlp == [512, 256, 128] and m.top_mlp == [1024, 1024, 512, 256, 1]
    if name == "dlrm_1tb":
        assert max(t.num_rows for t in tables) <= 40_000_000
    if name == "dcnv2_1tb":
        assert m.arch == "dcnv2" and sum(t.hotness for t in tables) > 26
    if name == "dlrm_1tb_uncapped":
        assert sum(t.num_rows for t in tables) == 882_774_559


def test_unknown_key_names_key_and_allowed_keys():
    with pytest.raises(
        ValueError,
        match=r"unknown config key 'train.stpes'; keys under 'train': steps, epochs, batch_size",
    ):
        validate(_compose("+train.stpes=3"))
    with pytest.raises(
        ValueError, match=r"unknown config key 'colour'; keys at the top level: seed, device"
    ):
        validate(_compose("+colour=red"))


def test_a_data_key_of_another_dataset_names_the_datasets_that_have_it():
    """`data.path=...` with the default synthetic data (or `data.name=criteo data.path=...`)
    was Hydra's bare "Key 'path' is not in struct"; the group choices on the command line
    (experiments included) decide which dataset's keys apply."""
    from hybridrec.config import check_override_keys

    for args in (["data.path=/x"], ["data.name=criteo", "data.path=/x"]):
        with pytest.raises(
            ValueError,
            match=r"'data.path' is not a key of data=synthetic; choose a dataset that has it, "
            r"e.g. data=criteo data.path=\.\.\. \(keys of data=synthetic: name, zipf",
        ):
            check_override_keys(args)
    with pytest.raises(ValueError, match=r"'data.preprocess.hash_cap' is not a key of data=crit"):
        check_override_keys(["data=criteo", "data.preprocess.hash_cap=10"])
    for fine in (
        ["data=criteo", "data.path=/x", "data.reader=dali"],
        ["experiment=mlperf_dlrm_1tb", "data.path=/x"],
        ["data=criteo_sample", "data.preprocess.min_count=3"],
        ["data=criteo,synthetic", "data.path=/x"],  # a sweep: Hydra judges each job
        ["data.zipf_exponent=1.2"],
    ):
        check_override_keys(fine)


@pytest.mark.parametrize(
    "override,message",
    [
        ("device=gpu", r"device='gpu' is not one of: auto, cpu, cuda"),
        (
            "optim.sparse.name=adamw",
            r"optim.sparse.name='adamw' is not one of: sgd, rowwise_adagrad, adam, adagrad",
        ),
        ("optim.dense.name=lamb", r"optim.dense.name='lamb' is not one of: sgd, adagrad, adam"),
        ("model.arch=dcn", r"model.arch='dcn' is not one of: dlrm, dcnv2"),
        ("model.pooling=max", r"model.pooling='max' is not one of: sum, mean"),
        ("model.hotness=[1,2]", r"model.hotness has 2 entries but there are 6 tables"),
        (
            "model.bottom_mlp=[64,8]",
            r"model.bottom_mlp must end with the tables' width, model.embedding_dim=16",
        ),
        ("model.top_mlp=[64,2]", r"model.top_mlp must end with 1"),
        ("train.steps=0", r"train.steps must be > 0"),
        ("optim.sparse.lr=-1", r"optim.sparse.lr must be > 0"),
        ("train.steps=abc", r"^train.steps must be an integer, got 'abc'$"),
        ("sharding.cache_halflife=0", r"sharding.cache_halflife must be > 0"),
    ],
)
def test_bad_values_name_key_and_choices(override, message):
    with pytest.raises(ValueError, match=message):
        validate(_compose(override))


def test_training_batch_must_split_over_ranks_the_eval_batch_need_not():
    cfg = _compose("train.batch_size=10", "eval.batch_size=12")
    validate(cfg, world_size=2)
    with pytest.raises(
        ValueError,
        match=r"train.batch_size=10 is the global batch and must be divisible by the world size 3"
        r" .*try train.batch_size=9 or 12$",
    ):
        validate(cfg, world_size=3)
    validate(_compose("train.batch_size=12", "eval.batch_size=10"), world_size=3)
    validate(_compose("train.batch_size=1026"), world_size=6)  # the default eval batch, 2048


def test_unknown_group_option_lists_choices():
    with pytest.raises(Exception, match=r"(?s)model/dlrm_huge.*Available options.*dlrm_kaggle"):
        _compose("model=dlrm_huge")


def test_command_line_key_typos_list_the_valid_keys():
    from hybridrec.config import check_override_keys

    check_override_keys(
        [
            "train.steps=3",
            "model=dlrm_kaggle",
            "+extra=1",
            "hydra.run.dir=x",
            "data=criteo_sample",
            "data.preprocess.min_count=2",
            "--help",
            "-m",
        ]
    )
    with pytest.raises(
        ValueError, match=r"unknown config key 'train.stpes'; keys under 'train': steps"
    ):
        check_override_keys(["train.stpes=3"])
    with pytest.raises(
        ValueError, match=r"unknown config key 'trian.steps'; keys at the top level: seed"
    ):
        check_override_keys(["trian.steps=3"])
    with pytest.raises(ValueError, match=r"keys under 'data.preprocess': encoding"):
        check_override_keys(["data.preprocess.min_cnt=3"])


def test_whole_split_eval_needs_a_finite_split():
    with pytest.raises(ValueError, match="eval.batches=null .* data.name=synthetic is an endless"):
        validate(_compose("eval.batches=null"))
    assert validate(_compose("data=criteo_sample", "eval.batches=null")).eval.batches is None


def test_pinned_tables_are_checked_by_name_and_mode():
    cfg = validate(_compose("sharding=auto", "sharding.tables={cat_0:row_wise,cat_2:host}"))
    assert cfg.sharding.tables == {"cat_0": "row_wise", "cat_2": "host"}
    with pytest.raises(ValueError, match=r"sharding.tables.cat_9: model dlrm_tiny has no table"):
        validate(_compose("sharding=auto", "sharding.tables={cat_9:row_wise}"))
    with pytest.raises(ValueError, match=r"sharding.tables.cat_0='rw' is not one of: table_wise"):
        validate(_compose("sharding=auto", "sharding.tables={cat_0:rw}"))
    with pytest.raises(ValueError, match="sharding.tables pins .* but sharding=none"):
        validate(_compose("sharding.tables={cat_0:row_wise}"))


def test_multi_hot_expansion_is_for_file_datasets():
    assert validate(_compose("data=criteo_sample", "data.multi_hot=synthetic")).data.multi_hot
    with pytest.raises(ValueError, match="data.multi_hot=synthetic expands a one-hot dataset"):
        validate(_compose("data.multi_hot=synthetic"))
    with pytest.raises(ValueError, match="data.multi_hot='yes' is not one of: none, synthetic"):
        validate(_compose("data=criteo_sample", "data.multi_hot=yes"))


def test_eval_split_is_for_file_datasets():
    """Synthetic data has one eval stream: `data.eval_split=test` used to evaluate it anyway
    and log "samples of split 'test'" (the command line refuses it before: check_override_keys)."""
    assert validate(_compose("data=criteo_sample", "data.eval_split=test")).data.eval_split
    with pytest.raises(ValueError, match="data.eval_split=test picks a split of a file dataset"):
        validate(_compose("data.eval_split=test"))


def test_every_schema_key_outside_data_can_be_overridden_in_every_group_option():
    """A key the schema knows but the composed YAML lacks cannot be set on the command line
    (Hydra: "Could not override"). Data keys differ by source on purpose."""
    import dataclasses
    from pathlib import Path

    from omegaconf import OmegaConf

    from hybridrec.config import Config

    def keys(node, prefix=""):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                yield from keys(value, f"{prefix}{f.name}.")
            else:
                yield prefix + f.name

    schema = [k for k in keys(Config()) if not k.startswith("data.")]
    for group in sorted(p for p in Path(CONF_DIR).iterdir() if p.is_dir()):
        for option in sorted(group.glob("*.yaml")):
            cfg = _compose(f"{group.name}={option.stem}")
            missing = [k for k in schema if OmegaConf.select(cfg, k, default=KeyError) is KeyError]
            assert not missing, f"{group.name}={option.stem} lacks {missing}"


def _leaves(node: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a nested dict (lists and None are values)."""
    out = {}
    for k, v in node.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _schema() -> dict:
    from omegaconf import OmegaConf

    from hybridrec.config import Config

    return OmegaConf.to_container(OmegaConf.structured(Config))


def _group_file(path) -> dict:
    """A conf/ file's keys as the config root sees them (its package applied), no `defaults`."""
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(OmegaConf.load(path))
    node.pop("defaults", None)
    if path.parent == CONF_DIR or path.read_text().startswith("# @package _global_"):
        return node
    return {path.parent.name: node}


def test_composed_defaults_are_the_schema_but_for_the_chosen_group_files():
    """The schema is the one source of defaults: with no overrides, every key is the schema's
    default unless the group option conf/train.yaml chooses sets it."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(_compose())
    raw.pop("hydra", None)
    choices = [
        next(iter(d.items()))
        for d in OmegaConf.load(CONF_DIR / "train.yaml").defaults
        if not isinstance(d, str) and next(iter(d.values())) is not None
    ]
    # sharding has no default option: the world size chooses (none on one rank, auto on several)
    assert {g for g, _ in choices} == {"model", "data", "optim", "logger"}
    set_by_groups = {}
    for group, option in choices:
        set_by_groups.update(_leaves(_group_file(CONF_DIR / group / f"{option}.yaml")))
    schema = _leaves(_schema())
    got = _leaves(raw)
    assert got.keys() == schema.keys()
    expected = {k: set_by_groups.get(k, v) for k, v in schema.items()}
    assert got == expected


def _schema_has(schema: dict, key: str) -> bool:
    node = schema
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
        if not isinstance(node, dict):  # a leaf (a list, or a dict-valued key like tables)
            return True
    return True


def test_every_key_in_conf_is_a_schema_key_and_group_files_set_only_what_differs():
    schema = _schema()
    defaults = _leaves(schema)
    for path in sorted(CONF_DIR.rglob("*.yaml")):
        keys = {k: v for k, v in _leaves(_group_file(path)).items() if not k.startswith("hydra.")}
        # model.args: the model class's own keyword arguments, a free dict
        unknown = [
            k for k in keys if not _schema_has(schema, k) and not k.startswith("model.args.")
        ]
        assert not unknown, f"{path.relative_to(CONF_DIR)}: {unknown} not in the schema"
        if path.parent.name == "experiment":  # presets state their recipe in full
            continue
        copied = [
            k
            for k, v in keys.items()
            if k in defaults and v == defaults[k] and k.rsplit(".", 1)[-1] not in ("name", "type")
        ]
        assert not copied, f"{path.relative_to(CONF_DIR)} repeats schema defaults: {copied}"


def test_data_keys_name_schema_keys_of_known_sources():
    from hybridrec.config import DATA_KEYS, fields_at
    from hybridrec.data.build import SOURCES

    assert tuple(sorted(DATA_KEYS)) == tuple(sorted(SOURCES))
    for keys in DATA_KEYS.values():
        assert set(keys) <= set(fields_at("data"))


def test_task_mistakes_name_the_key():
    """A stop target reads its task's metric; synthetic data has binary labels only."""
    file_data = ("data=criteo", "data.path=/data/x")
    with pytest.raises(ValueError, match=r"^model.task='ranking' is not one of: binary, regr"):
        validate(_compose("model.task=ranking"))
    with pytest.raises(ValueError, match=r"^model.task=regression needs float labels, but data="):
        validate(_compose("model.task=regression"))
    with pytest.raises(ValueError, match=r"^eval.target_auc=0.8 needs model.task=binary"):
        validate(_compose("model.task=regression", *file_data, "eval.target_auc=0.8"))
    with pytest.raises(ValueError, match=r"^eval.target_rmse=0.9 needs model.task=regression"):
        validate(_compose("eval.target_rmse=0.9"))
    with pytest.raises(ValueError, match=r"^eval.target_rmse must be > 0, got 0"):
        validate(_compose("model.task=regression", *file_data, "eval.target_rmse=0"))
    cfg = validate(_compose("model.task=regression", *file_data, "eval.target_rmse=0.9"))
    assert (cfg.model.task, cfg.eval.target_rmse) == ("regression", 0.9)


def test_the_command_line_sets_the_run_length_over_a_presets_epochs_or_steps(caplog):
    """`train.steps` and `train.epochs` both set the run's length: the one given on the
    command line wins over the other from a preset (a preset's epochs used to win, silently)."""
    import logging

    with caplog.at_level(logging.INFO, logger="hybridrec"):
        raw = _compose("experiment=movielens", "train.steps=20")
    assert raw.train.steps == 20 and raw.train.epochs is None
    assert "train.steps=20 from the command line: the run's length (train.epochs=6 of" in (
        caplog.text
    )
    assert _compose("experiment=movielens").train.epochs == 6  # the preset alone: its epochs
    # the other way round: epochs on the command line decide the steps (hybridrec.data.build)
    raw = _compose("experiment=kaggle_host_cache", "train.epochs=2")
    assert raw.train.epochs == 2
    # an explicit null with steps is what the rule does itself; both given is ambiguous
    assert (
        _compose("experiment=movielens", "train.steps=20", "train.epochs=null").train.epochs is None
    )
    with pytest.raises(
        ValueError,
        match=r"^train.steps=20 and train.epochs=2 both set the run's length; give one",
    ):
        _compose("experiment=movielens", "train.steps=20", "train.epochs=2")


def test_the_run_length_rule_holds_on_the_command_line(tmp_path):
    """hybridrec-train applies the same rule: both given is a one-line config error (exit 2)."""
    from tests.cli import run_cli

    out = run_cli("train.steps=3", "train.epochs=1", "data=criteo_sample", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == (
        "hybridrec-train: train.steps=3 and train.epochs=1 both set the run's length; give one "
        "(train.epochs sets the steps from the dataset)\n"
    )


def test_several_ranks_without_a_sharding_choice_plan_with_auto(caplog):
    """TorchRec plans by default: with no `sharding=` choice one rank is the one-process
    reference (none) and several ranks use the planner (auto), said in one log line; an
    explicit sharding=none stays none (several ranks refuse it: the next test)."""
    import logging

    assert validate(_compose()).sharding.type == "none"
    with caplog.at_level(logging.INFO, logger="hybridrec"):
        assert validate(_compose(), world_size=2).sharding.type == "auto"
    lines = [r.getMessage() for r in caplog.records if "no sharding chosen" in r.getMessage()]
    assert lines == [
        "sharding: 2 ranks and no sharding chosen: the planner places the tables "
        "(sharding=auto; choose another with sharding=<mode>)"
    ]
    assert validate(_compose("sharding=none"), world_size=2).sharding.type == "none"
    assert validate(_compose("sharding=row_wise"), world_size=2).sharding.type == "row_wise"
    assert validate(_compose("experiment=kaggle_host_cache"), world_size=2).sharding.type == "host"


def test_an_explicit_sharding_none_on_several_ranks_is_a_one_line_error(tmp_path):
    from tests.cli import run_cli

    out = run_cli("launcher.nproc_per_node=2", "sharding=none", "device=cpu", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith(
        "hybridrec-train: launcher.nproc_per_node=2 starts 2 ranks, but sharding=none keeps "
        "every table in one process"
    )
    assert len(out.stderr.splitlines()) == 1


@pytest.mark.slow
def test_two_ranks_without_a_sharding_choice_train_with_the_planner(tmp_path):
    """End to end: `launcher.nproc_per_node=2` alone (it was refused: sharding=none) plans."""
    from tests.cli import run_cli

    out = run_cli(
        "launcher.nproc_per_node=2",
        "device=cpu",
        "train.steps=2",
        "train.batch_size=64",
        "eval.every=0",
        "eval.batches=1",
        "eval.batch_size=64",
        f"hydra.run.dir={tmp_path}/r",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 ranks and no sharding chosen: the planner places the tables" in out.stderr
    assert "sharding plan (auto, 2 ranks)" in out.stderr


def test_the_criteo_sample_is_read_only_where_the_user_names_it(monkeypatch, tmp_path):
    """data=criteo_sample reads data.path or $HYBRIDREC_CRITEO_SAMPLE, never a folder outside
    the repository it guesses (it used to fall back to <repo>/../shared/data/)."""
    from hybridrec.data.source import SAMPLE_ENV, sample_path

    monkeypatch.delenv(SAMPLE_ENV, raising=False)
    with pytest.raises(
        ValueError,
        match=r"^data=criteo_sample needs the 200-row Criteo sample file \(criteo_sample.tsv, "
        r"not in this repository\): set data.path=<file> or \$HYBRIDREC_CRITEO_SAMPLE=<file>$",
    ):
        sample_path(None)
    named = tmp_path / "rows.tsv"
    named.write_text("x\n")
    assert sample_path(str(named)) == named
    monkeypatch.setenv(SAMPLE_ENV, str(named))
    assert sample_path(None) == named


def _float_keys(node, prefix=""):
    """(dotted key, type text) of every schema field whose type names float."""
    import dataclasses

    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _float_keys(value, f"{prefix}{f.name}.")
        elif "float" in str(f.type):
            yield prefix + f.name, str(f.type)


def test_every_float_key_refuses_nan_and_infinities():
    """NaN passes every comparison (`value < 0` is False), so `optim.sparse.weight_decay=nan`
    passed the >= 0 check and failed inside the run (exit 1) where `=-1` is a config error
    (exit 2). Every float key of the schema, walked here, refuses nan, inf and -inf in one
    line naming it; so do the entries of its list and mapping keys."""
    from omegaconf import OmegaConf

    from hybridrec.config import Config

    containers = {
        "model.mean_ids": ("model.mean_ids", [1.0, 0.5, 1.0, 1.0, 1.0, 1.0], 1),
        "optim.sparse.table_weight_decay": (
            "optim.sparse.table_weight_decay",
            {"cat_0": 0.0, "cat_2": 0.0},
            "cat_2",
        ),
    }
    keys = list(_float_keys(Config()))
    scalars = [k for k, t in keys if t in ("float", "float | None")]
    assert len(scalars) >= 25 and "optim.sparse.weight_decay" in scalars
    assert sorted(k for k, t in keys if k not in scalars) == sorted(containers)  # all covered
    default = OmegaConf.to_container(_compose())
    for bad in (float("nan"), float("inf")):  # -inf: below, one key (one isfinite check)
        for key in scalars:
            d = OmegaConf.create(default)
            OmegaConf.update(d, key, bad, force_add=True)
            with pytest.raises(ValueError) as e:
                validate(d)
            assert str(e.value) == f"{key} must be a finite number, got {bad}", key
        for key, (node, good, at) in containers.items():
            value = list(good) if isinstance(good, list) else dict(good)
            value[at] = bad
            d = OmegaConf.create(default)
            OmegaConf.update(d, node, value, force_add=True)
            with pytest.raises(ValueError) as e:
                validate(d)
            shown = f"[{at}]" if isinstance(at, int) else f".{at}"
            assert str(e.value) == f"{key}{shown} must be a finite number, got {bad}"
            value[at] = good[at]
            OmegaConf.update(d, node, value, force_add=True)
            validate(d)  # the same config with finite numbers is accepted
    with pytest.raises(ValueError, match=r"^optim.sparse.weight_decay must be a finite number"):
        validate(OmegaConf.merge(default, {"optim": {"sparse": {"weight_decay": float("-inf")}}}))
