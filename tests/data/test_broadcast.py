"""The rank-0 broadcasting loader on 2 and 3 gloo ranks.

Every rank must get exactly its slice [r*B/W, (r+1)*B/W) of the same global batch that a
single process reads, step after step (across an epoch boundary and from a resume point),
and the per_rank loader must give the same slices. A finite split ends on every rank at the
same step. A read error on rank 0 reaches the other ranks at once, and a rank 0 that never
sends makes the others fail after the group's timeout instead of hanging.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybridrec.data import open_dataset
from hybridrec.data.broadcast import BroadcastLoader, pack, unpack
from hybridrec.data.loader import BatchSource, SliceLoader
from hybridrec.data.source import BinarySource
from hybridrec.distributed import DistEnv
from tests.distributed.harness import spawn

B, STEPS, START = 24, 9, 3  # 160 train rows // 24 = 6 steps per epoch: crosses into epoch 2


def _source(path: str) -> BinarySource:
    return BinarySource(open_dataset(path), seed=11)


def _collect(env: DistEnv, path: str) -> dict:
    src = _source(path)
    out: dict = {}
    for name, loader in (
        ("broadcast", BroadcastLoader(src, env.rank, env.world_size, B, "train", START, env.group)),
        ("per_rank", SliceLoader(src, env.rank, env.world_size, B, "train", START, prefetch=2)),
    ):
        out[name] = [next(loader) for _ in range(STEPS)]
        out[name + "_position"] = loader.position
        loader.close()
    ev = BroadcastLoader(src, env.rank, env.world_size, 6, "eval", 0, env.group, prefetch=0)
    out["eval"] = list(ev)  # 20 val rows, batch 6: 4 steps on every rank (the last wraps)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_gets_its_slice_of_the_same_global_batch(world, sample_dataset):
    results = spawn(world, _collect, str(sample_dataset))
    src = _source(str(sample_dataset))
    n = B // world
    for step in range(STEPS):
        ref = src.batch(START + step, B, "train")
        for rank, res in enumerate(results):
            for name in ("broadcast", "per_rank"):
                got = res[name][step]
                want = ref.slice(rank * n, (rank + 1) * n)
                for x, y in (
                    (got.dense, want.dense),
                    (got.ids, want.ids),
                    (got.labels, want.labels),
                ):
                    assert x.dtype == y.dtype and torch.equal(x, y), (name, rank, step)
    for rank, res in enumerate(results):
        assert res["broadcast_position"] == res["per_rank_position"] == START + STEPS
        assert len(res["eval"]) == 4
        ev = src.batch(3, 6, "eval")
        torch.testing.assert_close(
            res["eval"][3].ids, ev.ids[rank * (6 // world) : (rank + 1) * (6 // world)]
        )


class _Failing(BatchSource):
    """A source whose rank-0 read fails at step 2."""

    def __init__(self, path: str) -> None:
        self.inner = _source(path)

    def steps_per_epoch(self, batch_size: int, split: str = "train") -> int:
        return self.inner.steps_per_epoch(batch_size, split)

    def batch(self, step: int, batch_size: int, split: str = "train"):  # noqa: ANN201
        if step == 2:
            raise OSError("disk on fire")
        return self.inner.batch(step, batch_size, split)


def _errors(env: DistEnv, path: str) -> dict:
    out: dict = {}
    loader = BroadcastLoader(_Failing(path), env.rank, env.world_size, 8, "train", 0, env.group)
    next(loader), next(loader)
    try:
        next(loader)
    except Exception as e:  # noqa: BLE001
        out["read_error"] = f"{type(e).__name__}: {e}"
    loader.close()
    # rank 0 never sends: the others must fail after the group's (short) timeout
    group = dist.new_group(list(range(env.world_size)), timeout=timedelta(seconds=2))
    if env.rank == 0:
        time.sleep(5)
        return out
    loader = BroadcastLoader(_source(path), env.rank, env.world_size, 8, "train", 0, group)
    t0 = time.monotonic()
    try:
        next(loader)
        out["timeout"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["timeout"] = f"{type(e).__name__} after {time.monotonic() - t0:.1f}s"
        out["timeout_s"] = time.monotonic() - t0
        out["timeout_msg"] = str(e)
    return out


@pytest.mark.slow
def test_rank0_errors_and_timeouts_reach_every_rank(sample_dataset):
    r0, r1 = spawn(2, _errors, str(sample_dataset))
    assert r0["read_error"] == "OSError: disk on fire"
    assert r1["read_error"].startswith("RuntimeError: rank 0 failed to read global batch 2")
    assert r1["timeout"] != "no error" and 1.5 <= r1["timeout_s"] < 5, r1["timeout"]
    msg = r1["timeout_msg"]  # the exchange, when and what, the group's own timeout
    assert msg.startswith("collective 'batch_broadcast' before the first training step failed on")
    assert "timed out after 2 s (dist.timeout_s)" in msg and "rank 0 did not arrive" in msg, msg


@pytest.mark.parametrize(("high", "id_bytes"), [(1 << 31, 4), (1 << 40, 8)])
def test_pack_unpack_round_trip(high, id_bytes):
    """Ids go as int32 when the batch's fit (40% fewer bytes for Criteo), else as int64:
    an out-of-range id is never wrapped into a valid-looking one."""
    from hybridrec.types import Batch

    ids = torch.randint(0, high, (6, 26))
    ids[0, 0] = high - 1
    b = Batch(torch.randn(6, 13), ids, torch.rand(6).round())
    p, got_bytes = pack(b)
    assert got_bytes == id_bytes
    assert p.dtype == torch.uint8 and p.numel() == 6 * (26 * id_bytes + 13 * 4 + 4)
    u = unpack(p, 6, 13, 26, id_bytes)
    assert torch.equal(u.ids.long(), b.ids) and torch.equal(u.dense, b.dense)
    assert torch.equal(u.labels, b.labels)


def test_single_rank_broadcast_loader_is_a_prefetching_reader(sample_dataset):
    src = _source(str(Path(sample_dataset)))
    loader = BroadcastLoader(src, 0, 1, 16, "train", 5, None, prefetch=3)
    got = [next(loader) for _ in range(4)]
    loader.close()
    for i, b in enumerate(got):
        assert torch.equal(b.ids, src.batch(5 + i, 16).ids)
