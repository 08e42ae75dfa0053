"""hybridrec-plot: reads what the trainer writes, labels sweep jobs, draws, and names bad input."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from hybridrec.distributed import DistEnv  # noqa: E402
from hybridrec.train.plot import main, parse_metric, smooth  # noqa: E402
from hybridrec.train.trainer import Trainer  # noqa: E402
from tests.configs import make_config  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _job(sweep: Path, n: int, overrides: list[str], rows: list[dict]) -> None:
    d = sweep / str(n)
    d.mkdir(parents=True)
    (d / "job.json").write_text(json.dumps({"job": n, "overrides": overrides}))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rows(scale: float) -> list[dict]:
    rows = [
        {"step": s, "split": "train", "loss": scale / s, "samples_per_sec": 1e5}
        for s in (10, 20, 30)
    ]
    return rows + [{"step": 30, "split": "eval", "auc": 0.7 + scale / 100, "logloss": 0.5}]


def _csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_a_real_run_is_plotted(tmp_path, capsys, caplog):
    """The trainer's own metrics.jsonl: its train and eval rows become the default panels;
    the run's closing log line says where they are and how to plot them."""
    cfg = make_config(
        "device=cpu", "train.steps=30", "train.log_every=10", "eval.every=15", "eval.batches=2"
    )
    with caplog.at_level(logging.INFO, logger="hybridrec"):
        Trainer(cfg, DistEnv(), run_dir=tmp_path / "run").fit()
    done = [r.message for r in caplog.records if r.message.startswith("done: 30 steps in ")]
    assert done and f"(hybridrec-plot {tmp_path / 'run'})" in done[0] and "val auc" in done[0]
    out = tmp_path / "curves.png"
    assert main([str(tmp_path / "run"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    got = _csv(out.with_suffix(".csv"))
    loss_steps = [int(r["step"]) for r in got if r["metric"] == "train/loss"]
    auc_steps = [int(r["step"]) for r in got if r["metric"] == "val/auc"]
    assert loss_steps == [10, 20, 30] and auc_steps == [15, 30]
    assert {r["run"] for r in got} == {"run"}
    assert "train/loss, val/auc, val/logloss, train/samples_per_sec" in capsys.readouterr().out


def test_sweep_jobs_are_labelled_by_the_overrides_that_differ(tmp_path):
    sweep = tmp_path / "sweep"
    _job(sweep, 0, ["sharding=row_wise", "train.steps=30"], _rows(1.0))
    _job(sweep, 1, ["sharding=table_wise", "train.steps=30"], _rows(2.0))
    (sweep / "summary.md").write_text("not a job")
    out = tmp_path / "s.png"
    assert main([str(sweep), "-o", str(out), "--metrics", "loss,auc", "--smooth", "2"]) == 0
    got = _csv(out.with_suffix(".csv"))
    assert {r["run"] for r in got} == {"sharding=row_wise", "sharding=table_wise"}
    tw_loss = [
        float(r["value"])
        for r in got
        if r["run"] == "sharding=table_wise" and r["metric"] == "loss"
    ]
    assert tw_loss == pytest.approx([2 / 10, 2 / 20, 2 / 30])  # the CSV keeps raw values
    auc = [r for r in got if r["metric"] == "auc"]
    assert [float(r["value"]) for r in auc] == pytest.approx([0.71, 0.72])


def test_several_paths_name_their_runs_apart(tmp_path):
    for day in ("a", "b"):
        _job(tmp_path / day / "sweep", 0, ["seed=1"], _rows(1.0))
        _job(tmp_path / day / "sweep", 1, ["seed=2"], _rows(1.0))
    out = tmp_path / "two.png"
    assert main([str(tmp_path / "a" / "sweep"), str(tmp_path / "b" / "sweep"), "-o", str(out)]) == 0
    runs = {r["run"] for r in _csv(out.with_suffix(".csv"))}
    assert len(runs) == 4  # the same sweep name twice: the jobs' paths tell them apart


def test_a_cut_line_is_skipped_with_its_file_and_line(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps(r) for r in _rows(1.0)]
    (run / "metrics.jsonl").write_text("\n".join(lines[:2] + ['{"step": 40, "spl'] + lines[2:]))
    with caplog.at_level(logging.WARNING, logger="hybridrec"):
        assert main([str(run), "-o", str(tmp_path / "c.png")]) == 0
    assert f"{run / 'metrics.jsonl'}:3 is not a JSON object" in caplog.text


def test_bad_input_is_named(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), "-o", str(tmp_path / "x.png")]) == 2
    assert "missing: no such file or directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty), "-o", str(tmp_path / "x.png")]) == 2
    assert f"{empty}: no metrics.jsonl" in capsys.readouterr().err
    _job(tmp_path / "sw", 0, [], _rows(1.0))
    assert (
        main([str(tmp_path / "sw"), "--metrics", "eval/nope", "-o", str(tmp_path / "x.png")]) == 2
    )
    err = capsys.readouterr().err
    assert "none of the metrics eval/nope" in err and "train/loss" in err and "val/auc" in err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "sw"), "--smooth", "0"])


def test_metric_names_and_smoothing():
    assert parse_metric("auc") == ("val", "auc")
    assert parse_metric("loss") == ("train", "loss")
    assert parse_metric("time_ms/lookup") == ("train", "time_ms/lookup")
    assert parse_metric("eval/accuracy") == ("val", "accuracy")  # files before "val" rows
    assert parse_metric("test/hr@10") == ("test", "hr@10") and parse_metric("ndcg@5")[0] == "val"
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([1.0, 3.0], 1) == [1.0, 3.0]


def test_a_single_train_point_is_drawn(tmp_path, monkeypatch):
    """A run logged once (train.steps == train.log_every, as in a short sweep) has one train
    point per metric: drawn as a line alone it leaves the panel empty, so it gets a marker."""
    import matplotlib.axes

    markers: dict[str, object] = {}
    real_plot = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        markers[kwargs.get("label")] = kwargs.get("marker")
        return real_plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 100, "split": "train", "loss": 0.4, "samples_per_sec": 1e5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(run), "-o", str(tmp_path / "c.png"), "--metrics", "loss"]) == 0
    assert markers == {"run": "o"}


def test_a_regression_run_gets_its_own_default_panels(tmp_path, capsys):
    """No AUC nor log loss in a regression run: the defaults draw its RMSE and MAE, and
    the defaults it did not log are not reported as missing."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "split": "train", "loss": 1 / s, "samples_per_sec": 1e5} for s in (5, 10)]
    rows.append({"step": 10, "split": "eval", "loss": 0.8, "rmse": 0.9, "mae": 0.7})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "c.png"
    assert main([str(run), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("train/loss, val/rmse, val/mae, train/samples_per_sec")
    assert {r["metric"] for r in _csv(out.with_suffix(".csv"))} == {
        "train/loss",
        "val/rmse",
        "val/mae",
        "train/samples_per_sec",
    }
    assert parse_metric("rmse") == ("val", "rmse")


def test_a_retrieval_run_gets_hr_and_ndcg_panels(tmp_path, capsys):
    """A retrieval run logs hr@K and ndcg@K for each K of eval.topk on its val rows (and a
    test row after training): the defaults draw the val split's at every K logged."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "split": "train", "loss": 6 / s, "samples_per_sec": 1e5} for s in (5, 10)]
    for step, split in ((5, "val"), (10, "val"), (10, "test")):
        rows.append(
            {"step": step, "split": split, "hr@10": step / 100, "ndcg@10": step / 200,
             "hr@50": step / 50, "ndcg@50": step / 80, "recall@10": 0.0, "eval_samples": 9}
        )  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "c.png"
    assert main([str(run), "-o", str(out)]) == 0
    drawn = "train/loss, val/hr@10, val/hr@50, val/ndcg@10, val/ndcg@50, train/samples_per_sec"
    assert capsys.readouterr().out.rstrip().endswith(drawn)
    got = _csv(out.with_suffix(".csv"))
    hr = [(int(r["step"]), float(r["value"])) for r in got if r["metric"] == "val/hr@10"]
    assert hr == [(5, 0.05), (10, 0.1)]  # the val rows only
    assert main([str(run), "-o", str(out), "--metrics", "test/hr@50,test/ndcg@K"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("test/hr@50, test/ndcg@10, test/ndcg@50")


def _run_dir(root: Path) -> Path:
    run = root / "outputs" / "2026-11-23" / "10-00-00"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(1.0)))
    return run


def test_a_run_or_sweep_is_plotted_into_its_own_directory(tmp_path, monkeypatch, capsys):
    """Without -o the PNG and CSV go into the run's directory (or the sweep's), never into
    the current one, and the command says where."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    run = _run_dir(tmp_path)
    assert main([str(run)]) == 0
    assert (run / "curves.png").read_bytes()[:8] == PNG_MAGIC
    assert (run / "curves.csv").is_file()
    assert (
        f"wrote {run / 'curves.png'} and {run / 'curves.csv'}: 1 run(s)" in capsys.readouterr().out
    )
    (run / "curves.png").unlink()
    assert main([str(run / "metrics.jsonl")]) == 0  # the file's directory
    assert (run / "curves.png").is_file()
    sweep = tmp_path / "multirun" / "2026-11-23" / "11-00-00"
    _job(sweep, 0, ["seed=1"], _rows(1.0))
    _job(sweep, 1, ["seed=2"], _rows(2.0))
    assert main([str(sweep)]) == 0
    assert (sweep / "curves.png").is_file() and not (sweep / "0" / "curves.png").exists()
    assert f"wrote {sweep / 'curves.png'}" in capsys.readouterr().out
    assert list(cwd.iterdir()) == []


def test_several_paths_need_o(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    a, b = _run_dir(tmp_path / "a"), _run_dir(tmp_path / "b")
    assert main([str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridrec-plot: 2 runs or sweeps given: name the PNG to write with -o")
    assert not list(tmp_path.glob("*.png")) and not (a / "curves.png").exists()
    assert main([str(a), str(b), "-o", str(tmp_path / "ab.png")]) == 0
    assert (tmp_path / "ab.png").is_file()


def test_a_failed_write_keeps_the_earlier_plot(tmp_path, monkeypatch, capsys):
    """The PNG is written beside its path and renamed into place: a disk that fills halfway
    through leaves the earlier plot as it was, and no temporary file."""
    import matplotlib.figure

    run = _run_dir(tmp_path)
    (run / "curves.png").write_bytes(b"earlier")

    def full_disk(self, fname, *args, **kwargs):
        Path(fname).write_bytes(b"half a PNG")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    assert main([str(run), "-o", str(run / "curves.png")]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert (run / "curves.png").read_bytes() == b"earlier"
    assert sorted(p.name for p in run.iterdir()) == ["curves.png", "metrics.jsonl"]
