"""Dynamic tables in checkpoints: the maps (ids in slots, LFU scores, last uses, totals, the
count policy's candidates) and the step clock are saved with the rows, so a resume is
bitwise the run that never stopped, at the same world size, and a checkpoint of 2 ranks
continues on 3 (the map arrays reshard by rows, as rows do: whole buckets) equal to it up to
float32 round-off, maps exactly. Model and data: tests/distributed/dynamic_model.py; saved
with the trainer's own save_checkpoint / load_checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.distributed import DistEnv
from hybridrec.sparse.api import embedding_modules
from hybridrec.train.checkpoint.format import TrainState, model_signature
from hybridrec.train.checkpoint.load import load_checkpoint
from hybridrec.train.checkpoint.save import save_checkpoint
from tests.distributed.dynamic_model import (
    STEPS,
    build,
    collect,
    full_maps,
    full_tables,
    run_steps,
)
from tests.distributed.harness import run_shared
from tests.libmodel import unwrap

pytestmark = pytest.mark.slow

CASE = ("row_wise", None, "adagrad", "lfu")  # count admission: candidates are carried too
SAVED_AT = 3


def _env(env) -> DistEnv:  # noqa: ANN001
    return env if env is not None else DistEnv()


def _signature(model) -> dict:  # noqa: ANN001
    tables = [t for m in embedding_modules(unwrap(model)) for t in m.tables]
    return model_signature(tables, unwrap(model), CASE[2], "sgd")


def save_then_continue(env, root: str) -> dict:  # noqa: ANN001
    """SAVED_AT steps, a checkpoint, the remaining steps without stopping."""
    env = _env(env)
    model, opt = build(env.group, *CASE)
    losses = run_steps(model, opt, env.group, range(SAVED_AT))
    state = TrainState(SAVED_AT, SAVED_AT, {})
    save_checkpoint(root, state, unwrap(model), opt, _signature(model), None, env)
    losses += run_steps(model, opt, env.group, range(SAVED_AT, STEPS))
    return collect(model, env.group, losses)


def resume(env, path: str) -> dict:  # noqa: ANN001
    """A fresh model (of this world size) loaded from `path`, trained to the end."""
    env = _env(env)
    model, opt = build(env.group, *CASE)
    state = load_checkpoint(path, unwrap(model), opt, _signature(model))
    assert state.step == SAVED_AT
    losses = run_steps(model, opt, env.group, range(SAVED_AT, STEPS))
    return collect(model, env.group, losses)


def _compare(got: list[dict], want: list[dict], bitwise: bool) -> None:
    if bitwise:
        assert got[0]["losses"] == want[0]["losses"][SAVED_AT:]
    else:
        torch.testing.assert_close(
            torch.tensor(got[0]["losses"]), torch.tensor(want[0]["losses"][SAVED_AT:])
        )
    for table, maps in full_maps(want).items():
        mine = full_maps(got)[table]
        assert mine["clocks"] == maps["clocks"] == {STEPS}
        assert mine["cand"] == maps["cand"], f"{table}: candidates"
        for key in ("slot_id", "score", "last"):
            assert torch.equal(mine[key], maps[key]), f"{table}.{key}"
    got_t, want_t = full_tables(got), full_tables(want)
    for table, entries in want_t.items():
        for name, value in entries.items():
            if bitwise:
                assert torch.equal(got_t[table][name], value), f"{table}.{name}"
            else:
                torch.testing.assert_close(got_t[table][name], value, rtol=1e-4, atol=1e-5)


def test_resume_is_bitwise_and_reshards_from_2_to_3_ranks(tmp_path):
    root = tmp_path / "ckpt"
    straight = run_shared(2, save_then_continue, str(root))
    path = str(root / f"step_{SAVED_AT}")
    _compare(run_shared(2, resume, path), straight, bitwise=True)
    _compare(run_shared(3, resume, path), straight, bitwise=False)
    _compare([resume(None, path)], straight, bitwise=False)  # and on one process
