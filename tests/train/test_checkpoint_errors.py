"""Single-process checkpoint behaviour: atomic saves, rotation, resume choices, integrity
and model checks, and the non-finite loss policies."""

from __future__ import annotations

import errno

import pytest
import torch

from hybridrec.distributed import init_distributed
from hybridrec.train import checkpoint as ckpt
from hybridrec.train.checkpoint import CheckpointError, list_checkpoints, read_manifest
from hybridrec.train.checkpoint import save as ckpt_save
from hybridrec.train.health import NonFiniteLossError
from hybridrec.train.trainer import Trainer
from tests.equivalence import make_cfg


def _trainer(tmp_path, steps=4, every=2, keep=3, resume="auto", check_ids=True, **model):
    cfg = make_cfg("none", "rowwise_adagrad", 1)
    cfg.train.check_ids = check_ids
    cfg.checkpoint.dir, cfg.checkpoint.every, cfg.checkpoint.keep = str(tmp_path), every, keep
    cfg.checkpoint.resume = resume
    cfg.train.steps, cfg.eval.batches = steps, 1
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return Trainer(cfg, init_distributed("cpu"))


def test_periodic_saves_rotate_and_resume_continues(tmp_path):
    t = _trainer(tmp_path, steps=6, every=2, keep=2)
    t.fit()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_4", "step_6"]
    assert not list(tmp_path.glob(".*.tmp"))
    t2 = _trainer(tmp_path, steps=8, every=2, keep=2)
    t2.restore()
    assert t2.step == 6
    t3 = _trainer(tmp_path, steps=8, resume="never")
    t3.restore()
    assert t3.step == 0
    t4 = _trainer(tmp_path, steps=8, resume=str(tmp_path / "step_4"))
    t4.restore()
    assert t4.step == 4
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        ckpt.resolve_resume(str(tmp_path), str(tmp_path / "step_99"))


def test_full_disk_keeps_previous_checkpoint(tmp_path, monkeypatch):
    t = _trainer(tmp_path, steps=2, every=2)
    t.fit()
    real_write = ckpt_save.write_file

    def full_disk(obj, path):
        if path.name == "dense.pt":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(obj, path)

    monkeypatch.setattr(ckpt_save, "write_file", full_disk)
    t.step = 4
    with pytest.raises(CheckpointError) as e:
        t.save()
    assert str(e.value) == (
        "saving checkpoint step 4 failed (rank 0: OSError: [Errno 28] No space left on "
        f"device); the previous checkpoint {tmp_path / 'step_2'} is intact: free space on the "
        f"disk of {tmp_path} (a save needs room for a second checkpoint beside step_2), or "
        "copy step_2 to a disk with room and set checkpoint.dir there, and resume"
    )
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2"]
    assert not list(tmp_path.glob(".*.tmp"))
    read_manifest(tmp_path / "step_2")  # still complete and valid


def test_full_disk_advice_fits_the_checkpoints_and_keep(tmp_path, monkeypatch):
    """ "Lower checkpoint.keep" was advised at keep=1, where it cannot help: the advice names
    the older checkpoints that can go now, and keep only where several are kept; an error
    that is not a full disk gets no advice about space."""
    t = _trainer(tmp_path, steps=6, every=2, keep=1)
    t.fit()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_6"]

    def full_disk(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_save, "write_file", full_disk)
    t.step = 8
    with pytest.raises(CheckpointError) as e:
        t.save()
    assert "keep" not in str(e.value) and str(e.value).endswith(
        "or copy step_6 to a disk with room and set checkpoint.dir there, and resume"
    )
    assert ckpt_save.room_advice(tmp_path, list_checkpoints(tmp_path), 1).startswith(
        f"free space on the disk of {tmp_path} (a save"
    )
    older = [tmp_path / "step_2", tmp_path / "step_4", tmp_path / "step_6"]
    assert ckpt_save.room_advice(tmp_path, older, 3) == (
        f"free space: delete step_2, step_4 in {tmp_path} (keep step_6 to resume from); a "
        "lower checkpoint.keep (now 3) keeps fewer from then on, and resume"
    )
    assert "keep (now" not in ckpt_save.room_advice(tmp_path, older, 1)

    def read_only(obj, path):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(ckpt_save, "write_file", read_only)
    with pytest.raises(CheckpointError) as e:
        t.save()
    assert str(e.value).endswith(
        f"Read-only file system); the previous checkpoint {tmp_path / 'step_6'} is intact: fix "
        "the cause above and resume"
    )


def test_corrupt_truncated_missing_files_are_named(tmp_path):
    _trainer(tmp_path, steps=2, every=2).fit()
    step = tmp_path / "step_2"
    shard = step / "shards_rank0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"shards_rank0.pt is corrupt: sha256 differs"):
        _trainer(tmp_path, steps=4).restore()
    shard.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match=r"has 100 bytes, the manifest says \d+ \(truncated"):
        _trainer(tmp_path, steps=4).restore()
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"missing its file shards_rank0.pt"):
        _trainer(tmp_path, steps=4).restore()
    (step / "manifest.json").unlink()  # incomplete: never picked by resume=auto
    assert list_checkpoints(tmp_path) == []


def test_checkpoint_of_another_model_lists_differences(tmp_path, monkeypatch):
    _trainer(tmp_path, steps=2, every=2).fit()
    import hybridrec.train.trainer as trainer_module

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the checkpoint was checked")

    with monkeypatch.context() as m:  # other tables: refused from the manifest, nothing built
        m.setattr(trainer_module, "build", never)
        with pytest.raises(
            CheckpointError,
            match=r"different model: table cat_4: checkpoint 20000x8, model 999x8; pick the model "
            r"it was saved with",
        ):
            _trainer(tmp_path, steps=4, num_embeddings_per_feature=[3, 40, 700, 5000, 999])
        with pytest.raises(  # many differences: the first four, then counts
            CheckpointError, match=r"model: table cat_0: .*; and 1 more \(1 table\); pick the"
        ):
            _trainer(tmp_path, steps=4, num_embeddings_per_feature=[1, 2, 3, 4, 5])
    other = _trainer(tmp_path, steps=4, bottom_mlp=[32, 8])  # same tables, other dense part
    with pytest.raises(
        CheckpointError,
        match=r"different model: dense bottom.0.bias: checkpoint \[16\], model \[32\]; "
        r"dense bottom.0.weight: checkpoint \[16, 13\], model \[32, 13\]",
    ):
        other.restore()


def test_corrupt_newest_checkpoint_names_the_intact_older_ones(tmp_path):
    _trainer(tmp_path, steps=6, every=2).fit()
    shard = tmp_path / "step_6" / "shards_rank0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        _trainer(tmp_path, steps=8).restore()
    msg = str(info.value)
    assert "shards_rank0.pt is corrupt: sha256 differs" in msg and "\n" not in msg
    assert "older intact checkpoints: step_4, step_2: resume from the newest with " in msg
    assert f"checkpoint.resume={tmp_path / 'step_4'} (or move {tmp_path / 'step_6'} away)" in msg
    t = _trainer(tmp_path, steps=8, resume=str(tmp_path / "step_4"))
    t.restore()
    assert t.step == 4


def test_init_from_a_checkpoint_directory_names_the_export_command(tmp_path):
    t = _trainer(tmp_path, steps=2, every=2)
    t.fit()
    with pytest.raises(CheckpointError) as info:
        ckpt.init_from_export(tmp_path / "step_2", t.model, list(t.cfg.model.tables()))
    assert str(info.value) == (
        f"model.init_from='{tmp_path / 'step_2'}' is a checkpoint directory, not an export: "
        f"resume from it with checkpoint.resume={tmp_path / 'step_2'} (weights and optimizer "
        f"state), or write an export with `hybridrec-export {tmp_path / 'step_2'} model.pt` "
        "and pass model.init_from=model.pt"
    )


def _nan_batch(t):
    batch = t.train_batch(0)
    batch.dense[0, 0] = float("nan")
    return batch


def test_nonfinite_loss_error_names_the_step(tmp_path):
    """A NaN input with the input checks off poisons the loss (with them on it is an input
    error: tests/train/test_dense_check.py)."""
    t = _trainer(tmp_path, check_ids=False)
    t.train_step(t.train_batch(0))
    t.step = 1
    t.train_step(_nan_batch(t))
    t.step = 2
    with pytest.raises(NonFiniteLossError, match=r"NaN or inf at step 2; .*train.check_ids=true"):
        t.check_finite()
    with pytest.raises(NonFiniteLossError):
        t.save()  # poisoned weights are never checkpointed


def test_nonfinite_skip_policy_drops_the_update(tmp_path):
    t = _trainer(tmp_path, check_ids=False)
    t.cfg.train.nonfinite = "skip"
    before = [w.clone() for _, w, _ in t.embeddings[0].shard_views()]
    dense_before = [p.clone() for p in t.model.parameters()]
    t.train_step(_nan_batch(t))
    assert t.skipped == 1
    for b, (_, w, _) in zip(before, t.embeddings[0].shard_views()):
        assert torch.equal(b, w)
    for b, p in zip(dense_before, t.model.parameters()):
        assert torch.equal(b, p)
    t.check_finite()  # nothing poisoned


def test_early_stop_at_target_auc(tmp_path):
    t = _trainer(tmp_path, steps=50, every=0)
    t.cfg.eval.every, t.cfg.eval.target_auc = 5, 0.51
    t.cfg.eval.batches = 4
    result = t.fit()
    evals = [r for r in t.history if r["split"] == "val"]
    assert t.step < 50 and evals[-1]["step"] == t.step and result["eval"]["auc"] >= 0.51
    assert all(r["auc"] < 0.51 for r in evals[:-1])
    assert list_checkpoints(tmp_path)[-1].name == f"step_{t.step}"  # saved on the way out


def test_export_cli(tmp_path, capsys):
    from hybridrec.train.export_cli import main

    _trainer(tmp_path / "ck", steps=2, every=2).fit()
    assert main([str(tmp_path / "ck"), str(tmp_path / "m.pt")]) == 0
    assert "5 tables and" in capsys.readouterr().out
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    assert state["embeddings.cat_4.weight"].shape == (20000, 8)
    assert main([str(tmp_path / "nothing"), str(tmp_path / "x.pt")]) == 2


def test_resume_with_another_data_stream_is_named(tmp_path, caplog):
    _trainer(tmp_path, steps=2, every=2).fit()
    t = _trainer(tmp_path, steps=4)
    t.cfg.train.batch_size, t.cfg.seed = 24, 8
    with caplog.at_level("WARNING", logger="hybridrec"):
        t.restore()
    assert "different training stream (train.batch_size 48 -> 24; seed 7 -> 8)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hybridrec"):
        _trainer(tmp_path, steps=4).restore()  # the same stream: nothing to say
    assert "different training stream" not in caplog.text


def test_resume_under_another_adam_eps_form_is_named(tmp_path, caplog):
    """The eps form is a setting, not state: a resume takes the config's, and says so when it
    differs from the one the checkpoint was saved with."""

    def adam(eps_form: str, steps: int = 4) -> Trainer:
        cfg = make_cfg("none", "adam", 1)
        cfg.checkpoint.dir, cfg.checkpoint.every = str(tmp_path), 2
        cfg.train.steps, cfg.eval.batches = steps, 1
        cfg.optim.sparse.eps_form = eps_form
        return Trainer(cfg, init_distributed("cpu"))

    adam("sparse_adam", steps=2).fit()
    assert read_manifest(tmp_path / "step_2")["extra"]["sparse_eps_form"] == "sparse_adam"
    with caplog.at_level("WARNING", logger="hybridrec"):
        adam("sparse_adam").restore()  # the same form: nothing to say
    assert "eps_form" not in caplog.text
    with caplog.at_level("WARNING", logger="hybridrec"):
        adam("adam").restore()
    assert (
        "resuming sparse adam saved with optim.sparse.eps_form=sparse_adam under "
        "optim.sparse.eps_form=adam" in caplog.text
    )
    assert "set optim.sparse.eps_form=sparse_adam to keep it" in caplog.text


def test_init_from_a_file_that_is_not_an_export_is_named(tmp_path):
    """model.init_from pointing at a truncated or non-torch file used to fail inside
    torch.load (an OSError 'Invalid argument', or a RuntimeError about mmap and zipfile
    serialization) without naming the file or the key."""
    t = _trainer(tmp_path / "ck", steps=2, every=2)
    t.fit()
    ckpt.export_checkpoint(tmp_path / "ck" / "step_2", tmp_path / "m.pt")
    data = (tmp_path / "m.pt").read_bytes()
    tables = list(t.cfg.model.tables())
    for name, content in (
        ("empty.pt", b""),
        ("half.pt", data[: len(data) // 2]),
        ("text.pt", b"hello"),
    ):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(
            CheckpointError, match=f"model.init_from='{tmp_path / name}': cannot be read"
        ):
            ckpt.init_from_export(tmp_path / name, t.model, tables)
    ckpt.init_from_export(tmp_path / "m.pt", t.model, tables)  # the intact file loads


def test_real_full_disk_error_says_so(tmp_path, monkeypatch):
    """On a really full filesystem torch.save into a file object does not raise the write's
    OSError: it raises "[enforce fail at inline_container.cc:672] . unexpected pos 1600 vs
    1494" with the ENOSPC only as its __context__ (seen on a 800k tmpfs). The save error
    must say the disk is full, not quote torch's internal position check."""
    t = _trainer(tmp_path, steps=2, every=2)
    t.fit()
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if getattr(f, "name", "").endswith("dense.pt"):
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError(  # noqa: B904 - the OSError stays its __context__
                    "[enforce fail at inline_container.cc:672] . unexpected pos 1600 vs 1494"
                )
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    t.step = 4
    with pytest.raises(
        CheckpointError,
        match=r"OSError: \[Errno 28\] No space left on device.*dense.pt.*step_2 is intact",
    ):
        t.save()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2"]


def test_unwritable_checkpoint_dir_fails_before_training(tmp_path):
    """A checkpoint.dir that cannot be created (here: under a regular file; a read-only
    filesystem is the same) used to surface as a bare NotADirectoryError/OSError at the
    first save, after all the training before it."""
    (tmp_path / "afile").write_text("")
    t = _trainer(tmp_path / "afile" / "ck", steps=4, every=0)
    with pytest.raises(CheckpointError, match=r"checkpoint.dir='.*afile/ck' cannot be written"):
        t.fit()
    assert t.step == 0


def test_export_cli_unwritable_output_is_one_line(tmp_path, capsys):
    """An output file that cannot be written (its directory is a file here; a read-only
    filesystem is the same) was a traceback from inside the export, not the CLI's error."""
    from hybridrec.train.export_cli import main

    _trainer(tmp_path / "ck", steps=2, every=2).fit()
    (tmp_path / "afile").write_text("")
    assert main([str(tmp_path / "ck"), str(tmp_path / "afile" / "m.pt")]) == 1  # at run time
    err = capsys.readouterr().err
    assert err.startswith("hybridrec-export: ") and str(tmp_path / "afile") in err
    assert "Traceback" not in err


def test_a_failed_export_leaves_no_partial_file(tmp_path, monkeypatch):
    """A write that fails midway (a full disk) removes its `<out>.tmp`; an earlier export
    at the same path stays as it was."""
    _trainer(tmp_path / "ck", steps=2, every=2).fit()
    out = tmp_path / "m.pt"
    ckpt.export_checkpoint(tmp_path / "ck" / "step_2", out)
    before = out.read_bytes()

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        ckpt.export_checkpoint(tmp_path / "ck" / "step_2", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "m.pt"]
    assert out.read_bytes() == before


def test_an_error_in_the_final_evaluation_keeps_the_training(tmp_path):
    """The last step's checkpoint is written before the final evaluation runs."""
    t = _trainer(tmp_path, steps=3, every=0)

    def broken():
        raise RuntimeError("evaluation failed")

    t.evaluate = broken
    with pytest.raises(RuntimeError, match="evaluation failed"):
        t.fit()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3"]
    resumed = _trainer(tmp_path, steps=3)
    resumed.restore()
    assert resumed.step == 3
