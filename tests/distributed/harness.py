"""Run a function on W gloo ranks in fresh processes and collect what each returns.

`spawn(world_size, fn, *args)` starts W processes (spawn context, one torch thread each), joins
them into a gloo group through a file:// rendezvous in a temp dir, calls fn(env, *args) on
every rank and returns the per-rank results. A rank that raises makes the whole call fail
with that rank's traceback; a run that outlives `timeout` is killed and reported, never hung.
A rank must exit 0: an abort at interpreter exit, even after all its work, is a failure.
`fn` must be a module-level function (it is pickled into the child processes).
`spawn_jobs(world_size, jobs)` runs several labelled jobs (fn, args) in one such spawn, one
after the other with a barrier between them, as separate spawns would (a process start is
most of a small job's time); a failing job's traceback names it.

`run_shared(world_size, fn, *args)` runs fn on the session's one process group of that size
(started on first use, kept until the test session ends): the equivalence suites share it,
so a world size costs one process start per rank for all of them. A job that fails, or
outlives its timeout, takes the group down with it (a failed collective leaves a group
unusable); the next job starts a fresh one. Jobs must leave no state behind that the next
one could read: each builds its own model and seeds its own generators.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _entry(
    fn: Callable, rank: int, world: int, init: str, out: str, args: tuple, timeout_s: float
) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("WANDB_MODE", "offline")
    from hybridrec.distributed import destroy_distributed, init_distributed

    env, ok = None, False
    try:
        env = init_distributed(
            "cpu", timeout_s=timeout_s, init_method=init, rank=rank, world_size=world
        )
        result = fn(env, *args)
        torch.save(result, Path(out) / f"result_{rank}.pt")
        del result
        gc.collect()  # free fn's models (DDP, collectives' work) before the group goes
        ok = True
    except BaseException:
        (Path(out) / f"error_{rank}.txt").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if env is not None:
            destroy_distributed(env, barrier=ok)
    (Path(out) / f"done_{rank}").touch()  # everything of ours finished; only exit is left


def spawn(
    world_size: int,
    fn: Callable,
    *args: Any,
    timeout: float = 240,
    dist_timeout: float = 60,
    exit_times: dict[int, float] | None = None,
) -> list[Any]:
    """Per-rank results of fn(env, *args); None for a rank that exited 0 without returning.
    `exit_times`, when given, receives each rank's process exit time (time.time())."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, init, tmp, args, dist_timeout))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        running = {p.sentinel: r for r, p in enumerate(procs)}
        while running and time.monotonic() < deadline:
            for s in mp_connection.wait(list(running), max(0.0, deadline - time.monotonic())):
                r = running.pop(s)  # type: ignore[call-overload]
                procs[r].join()
                if exit_times is not None:
                    exit_times[r] = time.time()
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = sorted(Path(tmp).glob("error_*.txt"))
        if errors:
            raise AssertionError("\n".join(f"--- {e.stem}\n{e.read_text()}" for e in errors))
        if alive:
            raise TimeoutError(f"ranks {alive} still running after {timeout}s")
        # a rank that finished everything must also exit 0 (no abort at interpreter exit)
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            finished = [r for r in range(world_size) if (Path(tmp) / f"done_{r}").exists()]
            raise AssertionError(
                f"ranks exited with errors (rank, exit code): {bad}; ranks {finished} had "
                "finished their work"
            )
        files = [Path(tmp) / f"result_{r}.pt" for r in range(world_size)]
        return [torch.load(f, weights_only=False) if f.exists() else None for f in files]


def run_jobs(env: Any, jobs: list[tuple[str, Callable, tuple]]) -> dict[str, Any]:
    """fn(env, *args) for each (label, fn, args) in order on this rank: results by label."""
    results = {}
    for label, fn, args in jobs:
        try:
            results[label] = fn(env, *args)
        except BaseException as e:
            e.add_note(f"in job {label!r}")
            raise
        if env.group is not None:  # the next job starts together, as a fresh spawn would
            dist.barrier(group=env.group)
    return results


def spawn_jobs(
    world_size: int, jobs: list[tuple[str, Callable, tuple]], **kwargs: Any
) -> dict[str, list[Any]]:
    """Per job label, the per-rank results of fn(env, *args), all jobs in one spawn."""
    labels = [label for label, _, _ in jobs]
    assert len(set(labels)) == len(labels), f"job labels repeat: {labels}"
    ranks = spawn(world_size, run_jobs, jobs, **kwargs)
    return {label: [r[label] for r in ranks] for label in labels}


def _serve(rank: int, world: int, init: str, conn: Any, timeout_s: float) -> None:
    """A rank of a shared group: run each (fn, args, out dir) it receives, barrier, reply."""
    torch.set_num_threads(1)
    os.environ.setdefault("WANDB_MODE", "offline")
    from hybridrec.distributed import init_distributed
    from hybridrec.distributed.env import shutdown

    env = init_distributed(
        "cpu", timeout_s=timeout_s, init_method=init, rank=rank, world_size=world
    )
    ok = True
    try:
        while (job := conn.recv()) is not None:
            fn, args, out = job
            try:
                result = fn(env, *args)
                torch.save(result, Path(out) / f"result_{rank}.pt")
                del result
                gc.collect()
                if env.group is not None:  # the next job starts together, as a fresh spawn
                    dist.barrier(group=env.group)
                conn.send("ok")
            except BaseException:
                (Path(out) / f"error_{rank}.txt").write_text(traceback.format_exc())
                conn.send("error")
                ok = False
                return
    finally:
        shutdown(barrier=ok)


class _Group:
    """`world` rank processes joined in one gloo group, serving jobs until closed."""

    def __init__(self, world: int, dist_timeout: float = 60) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.tmp = tempfile.TemporaryDirectory()
        init = f"file://{self.tmp.name}/rendezvous"
        self.conns, self.procs = [], []
        for r in range(world):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(r, world, init, theirs, dist_timeout), daemon=True)
            p.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(p)

    def run(self, fn: Callable, args: tuple, timeout: float) -> list[Any]:
        out = tempfile.mkdtemp(dir=self.tmp.name)
        for c in self.conns:
            c.send((fn, args, out))
        deadline = time.monotonic() + timeout
        replies: dict[int, str] = {}
        waiting = {c: r for r, c in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while len(replies) < self.world and time.monotonic() < deadline:
            ready = mp_connection.wait(
                [*waiting, *sentinels], max(0.0, deadline - time.monotonic())
            )
            for obj in ready:
                if obj in waiting:
                    r = waiting.pop(obj)
                    try:
                        replies[r] = obj.recv()
                    except (EOFError, OSError):  # its end of the pipe closed
                        replies[r] = "died"
                elif obj in sentinels:  # a rank exited without replying
                    replies.setdefault(sentinels.pop(obj), "died")
        # read before close(): it removes the directory the ranks wrote them in
        errors = [(e.stem, e.read_text()) for e in sorted(Path(out).glob("error_*.txt"))]
        if errors or len(replies) < self.world or set(replies.values()) != {"ok"}:
            self.close(kill=True)
            if errors:
                raise AssertionError("\n".join(f"--- {stem}\n{text}" for stem, text in errors))
            missing = [r for r in range(self.world) if replies.get(r) != "ok"]
            raise TimeoutError(f"ranks {missing} did not finish the job within {timeout}s")
        files = [Path(out) / f"result_{r}.pt" for r in range(self.world)]
        return [torch.load(f, weights_only=False) for f in files]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def stop(self) -> None:
        """Tell every rank to shut down (close() waits for them)."""
        for c in self.conns:
            try:
                c.send(None)
            except OSError:  # a rank already gone: close() reports its exit code
                pass

    def close(self, kill: bool = False) -> None:
        if not kill:
            self.stop()
        for p in self.procs:
            p.join(None if not kill else 0)
            if p.is_alive():
                p.kill()
                p.join()
        bad = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode != 0 and not kill]
        self.tmp.cleanup()
        if bad:
            raise AssertionError(f"shared ranks exited with errors (rank, exit code): {bad}")


_groups: dict[int, _Group] = {}


def run_shared(world_size: int, fn: Callable, *args: Any, timeout: float = 600) -> list[Any]:
    """Per-rank results of fn(env, *args) on the session's shared group of `world_size`
    ranks (module docstring)."""
    group = _groups.get(world_size)
    if group is None or not group.alive():
        group = _groups[world_size] = _Group(world_size)
    try:
        return group.run(fn, args, timeout)
    except BaseException:
        _groups.pop(world_size, None)
        raise


def close_shared() -> None:
    """End every shared group (at the end of the test session): each rank exits 0. All are
    told first, so they shut down side by side."""
    groups = list(_groups.values())
    _groups.clear()
    for group in groups:
        group.stop()
    for group in groups:
        group.close()
