"""On one GPU: host-resident tables (pinned host memory, CUDA cache, prefetch on a side stream
and a background thread) equal the CPU single-process reference.

Same setup as tests/distributed/test_host_equivalence.py (tiny caches that evict and write
back), over a one-rank NCCL group; fp32 everywhere, tolerance float32 round-off.
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.distributed import destroy_distributed, init_distributed
from tests.equivalence import ZIPF, assemble, collect, host_cfg, make_cfg

pytestmark = pytest.mark.gpu


def test_a_kernel_reads_and_writes_pinned_host_memory():
    from hybridrec.kernels.host_copy import kernel_works

    assert kernel_works(torch.device("cuda"))  # else host_copy=auto falls back to staged


def test_registered_host_tables_are_pinned_and_copy_both_ways():
    from hybridrec.kernels.host_copy import pinned_empty

    t = pinned_empty((1000, 3), torch.float32)  # cudaHostRegister, exact size
    assert t.is_pinned()
    t.copy_(torch.arange(3000.0).view(1000, 3))
    d = t.to("cuda", non_blocking=True)
    back = pinned_empty((1000, 3), torch.float32)
    back.copy_(d * 2, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(d.cpu(), t) and torch.equal(back, t * 2)


# prefetch: False, "background" (its admission on the group's thread and side stream, the
# default) or "admit here" (on the main thread, rows moving on the group's thread)
CASES = [
    (sparse, prefetch, host_copy, False)
    for sparse in ("sgd", "rowwise_adagrad", "adam")
    for prefetch in (False, "background")
    for host_copy in ("kernel", "staged", "auto")
] + [
    ("rowwise_adagrad", "background", "kernel", True),
    ("adam", "background", "staged", True),
    ("sgd", "admit here", "kernel", False),
    ("adam", "admit here", "staged", True),
]


@pytest.mark.parametrize("sparse,prefetch,host_copy,warm", CASES)
def test_host_cache_on_cuda_equals_cpu_reference(sparse, prefetch, host_copy, warm, monkeypatch):
    from hybridrec.sparse.host import HostCachedEmbedding

    monkeypatch.setattr(HostCachedEmbedding, "background", prefetch != "admit here")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref_cfg = make_cfg("none", sparse, 1)
    ref_cfg.data.zipf_exponent = ZIPF
    ref = collect(init_distributed("cpu"), ref_cfg, prefetch=False)
    cfg = host_cfg("host", sparse, 1)
    cfg.device, cfg.train.autocast = "cuda", "none"
    cfg.sharding.host_copy = host_copy
    env = init_distributed("cuda", timeout_s=60, force_group=True)
    try:
        got = collect(env, cfg, prefetch=bool(prefetch), warm=warm)
    finally:
        destroy_distributed(env)
    assert got["stats"].rows_written > 0
    assert got["pinned"] and all(got["pinned"])  # host tables are pinned on CUDA
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-5
    )
    want = assemble(ref_cfg, [{"shards": ref["shards"]}])
    shards = [(s, w.cpu(), {k: v.cpu() for k, v in st.items()}) for s, w, st in got["shards"]]
    have = assemble(cfg, [{"shards": shards}])
    for table, entries in want.items():
        for name, value in entries.items():
            torch.testing.assert_close(have[table][name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("prefetch", [False, True])
def test_host_step_syncs_with_the_host_a_bounded_number_of_times(prefetch):
    """sharding=host, kernel copies, a cache that evicts every step: an admission syncs
    once (the distinct rows and misses, read together), twice when it evicts unforeseen (how
    many slots can go); the backward's dedupe and update never (marking slots dirty writes
    no value from the host); a lookup handed what its prefetch admitted never. With prefetch
    the one admission runs on the group's background thread, so the main thread, which
    queues the device's work, never syncs, and the step syncs at most twice in all; without,
    the main thread syncs at most twice a step. Counted with CUDA sync-debug warnings, by
    thread (as on the CPU: tests/unit/test_host_syncs.py, test_no_sync_ops.py)."""
    import threading
    import warnings

    from hybridrec.train.trainer import Trainer

    cfg = host_cfg("host", "rowwise_adagrad", 1)
    cfg.device, cfg.train.autocast, cfg.train.kernels = "cuda", "none", "triton"
    cfg.sharding.host_copy = "kernel"
    env = init_distributed("cuda", timeout_s=60, force_group=True)
    try:
        trainer = Trainer(cfg, env)
        batches = [trainer.train_batch(s).to("cuda") for s in range(6)]
        pipe = trainer.pipeline(iter(batches))
        for _ in range(2):  # warmup: compiles kernels, fills the cache and allocator
            trainer.train_step(pipe.next(), pipe if prefetch else None)
        torch.cuda.synchronize()
        counts = []
        on_main: list[bool] = []  # per sync of a step: whether the main thread made it

        def show(message, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if "synchroniz" in str(message):
                on_main.append(threading.current_thread() is threading.main_thread())

        for _ in range(2, 5):
            on_main.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    trainer.train_step(pipe.next(), pipe if prefetch else None)
                    for g in trainer.embeddings[0].host_groups():
                        g._wait()  # the background admission's sync lands in this step
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counts.append((sum(on_main), len(on_main)))
        stats = trainer.embeddings[0].cache_stats()
    finally:
        destroy_distributed(env)
    assert stats.rows_written > 0  # it evicted dirty rows: the costly path ran
    main, total = zip(*counts, strict=True)
    if prefetch:
        assert max(main) == 0 and max(total) <= 2, counts
    else:
        assert max(main) <= 2 and max(total) <= 2, counts
