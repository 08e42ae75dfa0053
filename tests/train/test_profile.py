"""train.profile_steps: a torch.profiler window over a few steps, with the trainer's phases
as named regions and the host syncs inside the steps counted."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

from hybridrec.distributed import init_distributed
from hybridrec.train.profile import host_syncs
from hybridrec.train.trainer import Trainer
from tests.equivalence import make_cfg


def test_profile_window_writes_a_trace_with_the_phases(tmp_path, caplog):
    cfg = make_cfg("none", "adam", 1)
    cfg.train.steps, cfg.train.log_every, cfg.eval.batches = 6, 1, 1
    cfg.train.profile_start, cfg.train.profile_steps = 2, 3
    with caplog.at_level(logging.INFO, logger="hybridrec"):
        Trainer(cfg, init_distributed("cpu"), tmp_path).fit()
    trace = json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"train_step", "forward", "lookup", "backward", "dense_optimizer"} <= names
    steps = [e for e in trace["traceEvents"] if e.get("name") == "train_step"]
    assert len(steps) == 3, steps  # steps 3, 4 and 5
    assert "Self CPU" in (tmp_path / "profile" / "ops_rank0.txt").read_text()
    assert "profile of steps 3..5 written to" in caplog.text
    assert "host syncs in it: none" in caplog.text


def _event(name, start, end, thread=1):
    return SimpleNamespace(
        name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end)
    )


def test_host_syncs_counts_only_calls_inside_steps_on_the_step_thread():
    events = [
        _event("train_step", 0, 100),
        _event("cudaStreamSynchronize", 10, 12),  # inside: counted
        _event("cudaStreamSynchronize", 20, 22),
        _event("cudaMemcpyAsync", 30, 31),  # not a sync
        _event("cudaDeviceSynchronize", 150, 160),  # between steps (logging): left out
        _event("cudaEventSynchronize", 40, 41, thread=2),  # another thread (prefetch)
        _event("train_step", 200, 300),
        _event("cudaMemcpy", 250, 260),
    ]
    assert host_syncs(events) == {"cudaMemcpy": 1, "cudaStreamSynchronize": 2}
