"""Process-group set-up in one place: which device, which backend, which timeout.

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), picks NCCL for CUDA devices and gloo for CPU, and gives every collective a
timeout so a dead or stuck rank ends the job with an error instead of a hang. Without
torchrun it can still build a real one-rank group (a HashStore), so the sharded code path,
collectives included, runs in a single process too.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hybridrec.distributed import failure
from hybridrec.distributed.comm import release_held

log = logging.getLogger(__name__)
GLOO_WORKER = "pt_gloo_runloop"  # the name gloo's worker threads carry (ProcessGroupGloo)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: rank, world size, device and its process group (or None)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str | None:
        return None if self.group is None else dist.get_backend(self.group)


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto` -> this rank's GPU if CUDA is available, else CPU. `cuda` without CUDA -> error."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device=cuda but CUDA is not available here; use device=cpu or auto")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible"
            )
        return torch.device("cuda", local_rank)
    if name == "auto":
        return torch.device("cpu")
    raise ValueError(f"device={name!r} is not one of: auto, cpu, cuda")


def init_distributed(
    device: str = "auto",
    timeout_s: float = 300.0,
    force_group: bool = False,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> DistEnv:
    """Start (or skip) the process group and return this process's DistEnv.

    - under torchrun, or with `init_method`/`rank`/`world_size` given: join that group;
    - otherwise, with `force_group`: a one-rank group over an in-memory store;
    - otherwise: no group (plain single-process training).
    """
    if dist.is_initialized():
        raise RuntimeError("the default process group is already initialised")
    joining = init_method is not None or launched_by_torchrun()
    if joining:
        rank = int(os.environ["RANK"]) if rank is None else rank
        world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    else:
        rank, world_size, local_rank = 0, 1, 0
    dev = resolve_device(device, local_rank)
    if not joining and not force_group:
        return DistEnv(0, 1, 0, dev, None)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    kwargs: dict = {"backend": backend, "timeout": timeout, "rank": rank, "world_size": world_size}
    if dev.type == "cuda":
        kwargs["device_id"] = dev
    if joining and init_method is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(store=_attempt_store(rank, world_size, timeout), **kwargs)
    elif joining:
        dist.init_process_group(init_method=init_method or "env://", **kwargs)
    else:
        dist.init_process_group(store=dist.HashStore(), **kwargs)
    failure.group_started(timeout_s)
    log.info(
        "rank %d/%d joined a %s group on %s (timeout %.0fs)",
        rank,
        world_size,
        backend,
        dev,
        timeout_s,
    )
    return DistEnv(rank, world_size, local_rank, dev, dist.group.WORLD)


def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """torchrun's store, with keys scoped to this restart attempt.

    With `--max-restarts`, torchrun's workers share the agent's TCPStore across attempts;
    gloo then reads the previous attempt's peer addresses and fails to connect ("Connection
    refused", pytorch#135712). Prefixing every key with the attempt number isolates them.
    One agent restarts all its workers together, so on one node the number agrees; across
    nodes it may not, which is why launch/slurm_multinode.sbatch turns the shared store off
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh store per attempt, no prefix needed).
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,  # the agent hosts it
        timeout=timeout,
    )
    return dist.PrefixStore(f"hybridrec/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def destroy_distributed(env: DistEnv, barrier: bool = True) -> None:
    """Tear the group down; with `barrier`, first wait until every rank got here, so no rank
    closes its connections while a peer still talks (gloo aborts on that at exit). No
    barrier after a failed collective: a missing peer would hold it for another timeout."""
    if env.group is None or not dist.is_initialized():
        return
    shutdown(barrier)


def shutdown(barrier: bool = True) -> None:
    """End this process's part in a distributed run, so that it exits cleanly: wait for
    every rank (`barrier`; skipped after a failed collective, whose peer would never come),
    let go of the tensors hybridrec kept for its recent collectives (hybridrec.distributed.
    comm: gloo's worker threads must never be the ones to free them), then destroy the
    default process group. Call it once, at the end, on every rank (`hybridrec.shutdown()`
    in a script of your own, instead of dist.destroy_process_group()); a no-op without a
    process group."""
    if not dist.is_initialized():
        return
    if barrier and not failure.failed():  # after a failed collective it would wait in vain
        try:
            dist.barrier()
        except RuntimeError as e:  # a peer already failed: its own error says why
            log.warning("rank %d: barrier before shutdown failed: %s", dist.get_rank(), e)
    _wait_for_idle_gloo_workers()
    release_held()
    dist.destroy_process_group()


def _wait_for_idle_gloo_workers(timeout_s: float = 2.0) -> None:
    """Until every gloo worker thread of this process sleeps (idle, its last collective's
    bookkeeping done) twice in a row, or `timeout_s`: a worker that a busy machine had not
    yet scheduled might otherwise free a tensor after `release_held` (see comm). Reads the
    threads' states from /proc (Linux); elsewhere a short pause does the same job."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        time.sleep(0.05)
        return
    deadline, calm = time.monotonic() + timeout_s, 0
    while calm < 2 and time.monotonic() < deadline:
        time.sleep(0.001)  # the GIL is free meanwhile
        calm = calm + 1 if all(state == "S" for state in _gloo_worker_states(tasks)) else 0


def _gloo_worker_states(tasks: Path) -> list[str]:
    """The scheduler states (R running, S sleeping, ...) of gloo's worker threads."""
    states = []
    for task in tasks.iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread just ended
            continue
        name, _, rest = stat.partition("(")[2].rpartition(")")
        if name == GLOO_WORKER:
            states.append(rest.split()[0])
    return states
