"""Loading a checkpoint, an export or a warm-start file never runs code from the file.

A payload whose unpickling would create a marker file is planted in each kind of file
(dense state, embedding shards, export), with the manifest's size and sha256 updated as an
attacker with write access would. Resume, eval.only, hybridrec-export, model.init_from,
load_export and the checkpoint conversion (with or without --trust) must refuse it with one
line naming the file, suggesting the conversion only where it can work and naming the newest
intact checkpoint, and the marker must not exist. Manifest fields cannot name code to build.
Checkpoints written with numpy objects load again after the conversion, bit-identically.
"""

from __future__ import annotations

import json
import os
import shutil
import stat

import numpy as np
import pytest
import torch

from hybridrec.distributed import init_distributed
from hybridrec.model import load_export
from hybridrec.sparse.api import embedding_modules
from hybridrec.train.checkpoint import CheckpointError, export_checkpoint, read_manifest
from hybridrec.train.checkpoint.convert import main as convert_main
from hybridrec.train.checkpoint.format import dense_state, sha256, shard_views
from hybridrec.train.export_cli import main as export_main
from hybridrec.train.trainer import Trainer
from tests.equivalence import make_cfg


class Payload:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _cfg(ck_dir, steps=4, **kw):
    cfg = make_cfg("none", "rowwise_adagrad", 1)
    cfg.checkpoint.dir, cfg.checkpoint.every = str(ck_dir), 2
    cfg.train.steps, cfg.eval.batches = steps, 1
    for k, v in kw.items():
        section, key = k.split("__")
        setattr(getattr(cfg, section), key, v)
    return cfg


# the module's tests share one module-scoped fixture: one test worker runs them all, so it
# is built once (scripts/test.sh: pytest-xdist --dist loadgroup)
pytestmark = pytest.mark.xdist_group("train/test_checkpoint_security")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint after 2 steps (copied by each test before it plants anything)."""
    root = tmp_path_factory.mktemp("saved")
    Trainer(_cfg(root / "ck", steps=2), init_distributed("cpu")).fit()
    return root / "ck"


@pytest.fixture
def ck(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "ck")
    return tmp_path / "ck"


def _plant(step_dir, name, obj):
    """Replace `name` and make the manifest agree (size and sha256), as a writer could."""
    torch.save(obj, step_dir / name)
    mf = step_dir / "manifest.json"
    manifest = json.loads(mf.read_text())
    f = step_dir / name
    manifest["files"][name] = {"bytes": f.stat().st_size, "sha256": sha256(f)}
    mf.write_text(json.dumps(manifest))


def _one_line(e):
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_the_payload_runs_when_unpickled_fully(tmp_path):
    """The marker check below can fail: a full unpickle of a planted file creates it."""
    marker = tmp_path / "ran"
    torch.save({"x": Payload(marker)}, tmp_path / "f.pt")
    torch.load(tmp_path / "f.pt", weights_only=False)
    assert marker.exists()


def test_planted_dense_state_is_refused_by_resume_eval_only_and_export(ck, tmp_path, capsys):
    marker = tmp_path / "ran"
    step = ck / "step_2"
    dense = torch.load(step / "dense.pt", weights_only=True)
    dense["optimizer"] = Payload(marker)
    _plant(step, "dense.pt", dense)
    env = init_distributed("cpu")
    why = r"dense.pt: refused: it holds the pickled global posix.system.*nothing in it was run"
    with pytest.raises(CheckpointError, match=why) as e:
        Trainer(_cfg(ck), env).restore()
    text = _one_line(e)  # the conversion cannot help with code: it is not suggested
    assert "neither load nor convert it; no older intact checkpoint is in" in text
    assert "hybridrec.train.checkpoint.convert" not in text
    with pytest.raises(CheckpointError, match=why) as e:
        Trainer(_cfg(ck, eval__only=True), env).evaluate_only()
    _one_line(e)
    with pytest.raises(CheckpointError, match=why) as e:
        export_checkpoint(step, tmp_path / "m.pt")
    _one_line(e)
    assert export_main([str(ck), str(tmp_path / "m.pt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hybridrec-export: ") and err.count("\n") == 1 and "refused" in err
    assert not marker.exists() and not (tmp_path / "m.pt").exists()


def test_planted_shard_file_is_refused_by_resume_and_export(ck, tmp_path):
    marker = tmp_path / "ran"
    step = ck / "step_2"
    shards = torch.load(step / "shards_rank0.pt", weights_only=True)
    shards["shards"][0]["state"] = {"momentum": Payload(marker)}
    _plant(step, "shards_rank0.pt", shards)
    why = r"shards_rank0.pt: refused: it holds the pickled global posix.system"
    with pytest.raises(CheckpointError, match=why) as e:
        Trainer(_cfg(ck), init_distributed("cpu")).restore()
    _one_line(e)
    with pytest.raises(CheckpointError, match=why):
        export_checkpoint(step, tmp_path / "m.pt")
    assert not marker.exists()


def test_planted_export_is_refused_by_init_from_and_load_export(ck, tmp_path):
    marker = tmp_path / "ran"
    out = tmp_path / "m.pt"
    export_checkpoint(ck / "step_2", out)
    state = torch.load(out, weights_only=True)
    torch.save({**state, "dense.extra": Payload(marker)}, out)
    cfg = _cfg(tmp_path / "fresh", model__init_from=str(out))
    with pytest.raises(CheckpointError, match=r"model.init_from='.*m.pt': refused: it holds") as e:
        Trainer(cfg, init_distributed("cpu")).restore()
    _one_line(e)
    with pytest.raises(ValueError, match=r"m.pt: refused: it holds the pickled global") as e:
        load_export(out)
    _one_line(e)
    assert not marker.exists()


def test_manifest_fields_cannot_name_code_or_other_files(ck, tmp_path, capsys):
    """The model config an export carries comes from the manifest: hybridrec-export checks it
    before copying it (settings only, a registered architecture, a `_target_` that is the
    import path of a model class, as training checked it), and load_export refuses a file
    carrying a Hydra-style _target_ (unless the caller names that class) or an unregistered
    architecture: never built or called."""
    marker = tmp_path / "ran"
    step = ck / "step_2"
    mf = step / "manifest.json"
    original = json.loads(mf.read_text())
    state = torch.load(_export(ck, tmp_path / "good.pt"), weights_only=True)
    for model, at_export, at_load in (
        (
            {"_target_": "os.system", "command": f"touch {marker}"},
            r"model_config keys \['command'\] are not model settings; refused",
            r"'_target_'.*not model",
        ),
        (
            {"_target_": "os.system"},
            r"model _target_='os.system' names the standard library, not a model class; "
            r"refused \(a hand-edited manifest\? export the checkpoint training wrote\)",
            r"'_target_'.*not model",
        ),
        (
            {"_target_": "torch.nn.functional.relu"},
            r"model._target_=torch.nn.functional.relu is not an nn.Module class; refused",
            r"'_target_'.*not model",
        ),
        (
            {"_target_": "no_such_package.Model"},
            r"model._target_=no_such_package.Model does not import: .*PYTHONPATH\?\); refused",
            r"'_target_'.*not model",
        ),
        (
            {"_target_": "__import__('os').system"},
            r"model _target_=.* is not the import path of a model class \(pkg.module.Class\)",
            r"'_target_'.*not model",
        ),
        (
            {"arch": "os.system"},
            r"model_config arch 'os.system' is not one of",
            r"model_config arch 'os.system' is not one of",
        ),
        ("os.system", r"model_config is not a JSON object", r"model_config is not a JSON object"),
    ):
        m = json.loads(json.dumps(original))
        m["extra"]["model"] = {**m["extra"]["model"], **model} if isinstance(model, dict) else model
        mf.write_text(json.dumps(m))
        # the user names the class the manifest names (else it is refused before any check:
        # tests/train/test_export_open_world.py); the checks then are training's
        named = model.get("_target_") if isinstance(model, dict) else None
        flag = ["--model", named] if named else []
        with pytest.raises(CheckpointError, match=at_export) as e:
            export_checkpoint(step, tmp_path / "m.pt", model=named)
        assert _one_line(e).startswith(f"{mf}: ")
        assert not (tmp_path / "m.pt").exists()
        assert export_main([str(step), str(tmp_path / "m.pt"), *flag]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"hybridrec-export: {mf}: ") and err.count("\n") == 1
        # an export file written by other means: load_export's own checks
        torch.save({**state, "model_config": json.dumps(m["extra"]["model"])}, tmp_path / "x.pt")
        with pytest.raises(ValueError, match=at_load) as e:
            load_export(tmp_path / "x.pt")
        _one_line(e)
    m = json.loads(json.dumps(original))
    m["files"]["../../elsewhere.pt"] = m["files"].pop("dense.pt")
    mf.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"lists file '../../elsewhere.pt'.*refused") as e:
        read_manifest(step)
    _one_line(e)
    assert not marker.exists()


def _export(ck, out):
    assert export_main([str(ck), str(out)]) == 0
    return out


def _assert_same(a, b):
    """Exact equality of nested state (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) and a.dtype == b.dtype
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _restored(ck_dir):
    t = Trainer(_cfg(ck_dir), init_distributed("cpu"))
    t.restore()
    weights = [w.clone() for _, w, _ in shard_views(embedding_modules(t.model))]
    state = dense_state(t.model), t.dense_opt.state_dict(), torch.get_rng_state()
    return t.step, weights, *state


def test_a_checkpoint_with_pickled_objects_loads_after_the_trusted_conversion(ck, tmp_path):
    """As an older writer could have left it: RNG state as a numpy array, the step count as
    a numpy integer. Refused (naming the command), converted on purpose, then bit-identical."""
    reference = tmp_path / "reference"
    shutil.copytree(ck, reference)
    step = ck / "step_2"
    dense = torch.load(step / "dense.pt", weights_only=True)
    dense["rng_cpu"] = dense["rng_cpu"].numpy()
    dense["sparse_step"] = np.int64(dense["sparse_step"])
    _plant(step, "dense.pt", dense)
    with pytest.raises(CheckpointError, match=r"numpy.*checkpoint.convert .*step_2") as e:
        _restored(ck)
    _one_line(e)
    assert convert_main([str(ck)]) == 0  # it builds numpy data only: no --trust needed
    read_manifest(step)  # sizes and sha256 sums updated
    assert convert_main([str(ck), "--trust"]) == 0  # idempotent; --trust, as older versions
    got, want = _restored(ck), _restored(reference)
    assert got[0] == want[0] == 2
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)
    _assert_same(got[2], want[2])
    _assert_same(got[3], want[3])
    _assert_same(got[4], want[4])
    converted = torch.load(step / "dense.pt", weights_only=True)
    _assert_same(converted, torch.load(reference / "step_2" / "dense.pt", weights_only=True))


def test_checkpoint_directories_are_private(saved):
    for d in (saved, saved / "step_2"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


def test_convert_never_runs_a_planted_file_and_names_the_intact_checkpoint(tmp_path, capsys):
    """step_2 intact, step_4's dense.pt planted (as the audit found it: `convert --trust` ran
    the payload, the refusal suggested it and named no intact checkpoint). Now resume, the
    conversion (with or without --trust) and the refusal all name step_2, suggest no
    conversion, leave the files as they are, and never run the payload; a file mixing numpy
    data with a callable is refused by the conversion too, listing the callable."""
    ck = tmp_path / "ck"
    Trainer(_cfg(ck, steps=4), init_distributed("cpu")).fit()
    marker = tmp_path / "ran"
    step = ck / "step_4"
    dense = torch.load(step / "dense.pt", weights_only=True)
    dense["optimizer"] = Payload(marker)
    _plant(step, "dense.pt", dense)
    before = (step / "dense.pt").read_bytes()
    intact = f"the newest intact checkpoint before it is {ck / 'step_2'}: resume from it with "
    intact += f"checkpoint.resume={ck / 'step_2'}"
    with pytest.raises(CheckpointError, match="posix.system") as e:
        Trainer(_cfg(ck), init_distributed("cpu")).restore()
    text = _one_line(e)
    assert text.endswith(intact) and "checkpoint.convert" not in text
    for argv in ([str(step), "--trust"], [str(ck), "--trust"], [str(step)]):
        assert convert_main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == (
            f"hybridrec-convert: {step / 'dense.pt'}: refused: it holds the pickled global "
            "posix.system, not only tensors, numbers, strings, lists and dicts; nothing in it "
            "was run. That is code, not data hybridrec writes (a planted or foreign file): "
            f"neither load nor convert it; {intact}"
        )
    assert (step / "dense.pt").read_bytes() == before
    dense = torch.load(ck / "step_2" / "dense.pt", weights_only=True)
    dense["rng_cpu"] = dense["rng_cpu"].numpy()
    dense["optimizer"] = Payload(marker)
    _plant(ck / "step_2", "dense.pt", dense)
    assert convert_main([str(ck / "step_2"), "--trust"]) == 1
    err = capsys.readouterr().err
    assert "refused: it holds the pickled global posix.system, not only" in err
    assert "no older intact checkpoint is in" in err
    assert not marker.exists()
