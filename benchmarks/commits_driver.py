"""One rank of one side of benchmarks/commits.py: a model built by a checkout's own code,
stepped on command.

benchmarks/commits.py runs a copy of this file (outside any checkout) as `python COPY SPEC` in a
checkout of the commit under test (cwd and PYTHONPATH at that checkout), so every import below
resolves to that commit's code. It may therefore use only what every compared commit has: the two
benchmarks' config functions (sharding_gloo.parse_args / make_cfg / plan_summary,
dynamic_step.make_cfg / make_batches), Trainer(cfg, DistEnv), Trainer.train_batch,
Trainer.train_step, init_distributed / destroy_distributed, kernels.native.lib.

SPEC (JSON): {"bench": "sharding_gloo" | "dynamic_step", "variant": a sharding mode or
"none" | "dynamic" | "fixed", "world": W, "rank": r, "init": a file:// rendezvous (ranks of one
side share it; absent: no process group), "steps": batches to prepare, "args": the benchmark's
own command-line arguments}.

Protocol, one JSON object per line: on its private stdout the rank first writes
{"ready": ...} (its hybridrec's path, whether the C kernels loaded, the plan, one digest per
batch), then for every {"step": i} it reads on stdin it meets its peers at a barrier, times
`train_step` on batch i (cycled) and writes {"t": wall seconds, "cpu": CPU seconds of this
process (all its threads), "loss": its local loss}; {"quit": true} ends it. Anything the
code under test prints goes to stderr, never into the protocol.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time


def _digest(obj: object) -> str:
    """A short hash of every tensor in a batch (its fields in order): the two sides train on
    the same data only if these agree."""
    import torch

    h = hashlib.sha256()

    def add(x: object) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                add(getattr(x, f.name))
        elif isinstance(x, (tuple, list)):
            for y in x:
                add(y)
        else:
            h.update(repr(x).encode())

    add(obj)
    return h.hexdigest()[:16]


def _dynamic_args(argv: list[str]) -> object:
    """dynamic_step's own parsed arguments (its defaults, at this commit): its main() parses
    argv and then calls make_cfg(args, ...), which is intercepted here before anything runs."""
    from benchmarks import dynamic_step

    class Parsed(Exception):
        pass

    def capture(args: object, dynamic: bool) -> None:
        raise Parsed(args)

    make_cfg = dynamic_step.make_cfg
    dynamic_step.make_cfg = capture
    try:
        dynamic_step.main(argv)
    except Parsed as parsed:
        return parsed.args[0]
    finally:
        dynamic_step.make_cfg = make_cfg
    raise RuntimeError("dynamic_step.main() returned without calling make_cfg")


def build(spec: dict, env: object) -> tuple[object, list, str]:
    """(trainer, batches, plan summary) for the spec, with this checkout's own code."""
    import torch

    from hybridrec.train.trainer import Trainer

    if spec["bench"] == "sharding_gloo":
        from benchmarks import sharding_gloo

        args = sharding_gloo.parse_args(["--world-sizes", str(spec["world"]), *spec["args"]])
        cfg = sharding_gloo.make_cfg(args, spec["variant"], spec["world"])
        trainer = Trainer(cfg, env)
        batches = [trainer.train_batch(s) for s in range(spec["steps"])]
        return trainer, batches, sharding_gloo.plan_summary(trainer.plan)
    from benchmarks import dynamic_step

    args = _dynamic_args(spec["args"])
    torch.manual_seed(0)  # as dynamic_step.main
    fixed_cfg, caps = dynamic_step.make_cfg(args, dynamic=False)
    fixed, raw = dynamic_step.make_batches(args, fixed_cfg, caps)
    if spec["variant"] == "dynamic":
        cfg, batches = dynamic_step.make_cfg(args, dynamic=True)[0], raw
    else:
        cfg, batches = fixed_cfg, fixed
    return Trainer(cfg, env), batches, "-"


def main() -> None:
    spec = json.loads(sys.argv[1])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # prints of the code under test go to stderr; the protocol keeps stdout

    def send(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")

    import torch
    import torch.distributed as dist

    import hybridrec
    from hybridrec.distributed import DistEnv, destroy_distributed, init_distributed
    from hybridrec.kernels import native

    torch.set_num_threads(1)
    os.environ.setdefault("WANDB_MODE", "offline")
    if spec.get("init"):
        env = init_distributed(
            "cpu",
            timeout_s=300,
            init_method=spec["init"],
            rank=spec["rank"],
            world_size=spec["world"],
        )
    else:
        env = DistEnv(device=torch.device("cpu"))
    trainer, batches, plan = build(spec, env)
    send(
        {
            "ready": True,
            "hybridrec": os.path.dirname(os.path.abspath(hybridrec.__file__)),
            "native": native.lib() is not None,
            "plan": plan,
            "digests": [_digest(b) for b in batches],
        }
    )
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("quit"):
            break
        if env.group is not None:
            dist.barrier(group=env.group)
        batch = batches[msg["step"] % len(batches)]
        t0, c0 = time.perf_counter(), time.process_time()
        loss = trainer.train_step(batch)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        send({"t": dt, "cpu": cpu, "loss": float(loss)})
    del trainer
    destroy_distributed(env)


if __name__ == "__main__":
    main()
