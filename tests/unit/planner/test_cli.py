"""hybridrec-plan: plans for named models and yaml paths, errors as exit code 2."""

from __future__ import annotations

import pytest

from hybridrec.optim.sparse import SPARSE_OPTIMIZERS
from hybridrec.plan_cli import main
from hybridrec.planner import OPTIMIZERS


def test_cli_plans_the_113b_model(capsys):
    assert main("--model dlrm_1tb_uncapped --world-size 8 --hbm-gb 80".split()) == 0
    out = capsys.readouterr().out
    assert "cat_19" in out and "column_wise" in out
    assert "over 8 ranks, peak rank" in out and "of 75.0 GiB budget" in out


def test_cli_reports_plans_that_do_not_fit(capsys):
    assert main("--model dlrm_1tb_uncapped --world-size 4 --hbm-gb 80 --no-host".split()) == 2
    err = capsys.readouterr().err
    assert "rank 3: needs" in err and "GiB" in err
    # without --no-host, auto keeps the largest tables in host memory instead
    assert main("--model dlrm_1tb_uncapped --world-size 4 --hbm-gb 80".split()) == 0
    assert "@host(cache" in capsys.readouterr().out


def test_cli_accepts_a_yaml_path_and_rejects_bad_input(capsys, tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text(
        "name: m\nembedding_dim: 8\nnum_embeddings_per_feature: [100, 5]\n"
        "hotness: [2, 1]\npooling: mean\nbottom_mlp: [32, 8]\n"
    )
    argv = ["--model", str(model)] + (
        "--world-size 2 --batch-size 64 --mode row_wise --optimizer adam --weight-bytes 2".split()
    )
    assert main(argv) == 0
    assert "row_wise" in capsys.readouterr().out
    assert main(["--model", "no_such_model"]) == 2
    assert "dlrm_kaggle" in capsys.readouterr().err  # lists the known models
    assert main(["--world-size", "3", "--batch-size", "100"]) == 2
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0


def test_cli_shows_host_placement_and_host_memory(capsys):
    code = main(
        ["--model", "dlrm_1tb", "--world-size", "1", "--hbm-gb", "80", "--reserve-gb", "64"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "cat_0" in out and "@host(cache" in out
    assert "host memory per rank for host-resident tables" in out


def test_cli_pins_tables(capsys):
    args = ["--model", "dlrm_kaggle", "--world-size", "2", "--hbm-gb", "80"]
    assert main([*args, "--pin", "cat_2=row_wise", "--mode", "table_wise"]) == 0
    out = capsys.readouterr().out
    assert "pinned by sharding.tables: 2 row ranges" in out
    assert main([*args, "--pin", "cat_2"]) == 2
    assert "expected TABLE=MODE" in capsys.readouterr().err


def test_cli_sizes_every_optimizer_the_trainer_offers(capsys):
    """--optimizer takes the trainer's choices; the planner has a state footprint for each."""
    assert set(SPARSE_OPTIMIZERS) <= set(OPTIMIZERS)
    for name in SPARSE_OPTIMIZERS:
        assert main(f"--model dlrm_tiny --world-size 2 --optimizer {name}".split()) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main("--model dlrm_tiny --optimizer adamw".split())
    assert "invalid choice: 'adamw'" in capsys.readouterr().err


def test_cli_plans_any_model_the_trainer_builds(capsys):
    """The tables planned are the ones the model declares: a model class by name (its tables
    named by module path) and a user's class by import path (imported on purpose)."""
    argv = "--world-size 2 --batch-size 64 --mode row_wise".split()
    two_tower = [
        "model.arch=two_tower",
        "+model.args.user_features=[cat_0,cat_1]",
        "+model.args.item_features=[cat_2,cat_3]",
    ]
    assert main([*argv, *two_tower]) == 0
    out = capsys.readouterr().out
    assert "model two_tower" in out or "model.arch=two_tower" in out
    assert "users.cat_0" in out and "item_bias.cat_2" in out
    assert main([*argv, "model._target_=tests.models.user_model.TinyUser"]) == 0
    assert "TinyUser" in capsys.readouterr().out
    assert main([*argv, "model._target_=no_such.Model"]) == 2
    assert "does not import" in capsys.readouterr().err
