"""CPU stand-in for the GPU's sync checks (tests/gpu/test_gpu_nosync.py, test_gpu_host.py):
whole training steps issue no op that makes CUDA wait for the device, but at the documented
sync points.

On the GPU, torch.cuda.set_sync_debug_mode proves it. Here the steps run on the CPU (Triton
kernels in its interpreter) under tests.syncs.SyncRecorder, which flags, each at the
hybridrec line that issued it: a value read on the host (.item(), .tolist(), bool(), int(),
.cpu()); an output size that depends on the data (nonzero, unique, masked_select, a boolean
mask in indexing or index_put, bincount, repeat_interleave without output_size); a Python
scalar written through a tensor index (`t[idx] = 1.0`: on CUDA a copy from pageable host
memory, which waits for the device). The backward's sparse update is recorded too.

The documented sync points (tests.syncs.ALLOWED, docs/host-cache.md "Host syncs"): an
admission reads the distinct-row and miss counts in one `.tolist()` (cache._admit), and only
when it must evict unforeseen a second time, how many slots may go (_choose_slots); on one
rank a jagged list's real ids are found once per batch (exchange.sample_major.sample_major_inputs). Anything
else fails, the backward's dedupe and update and the lookup of a prefetched batch included.
Covered: DLRM on one process (every optimizer); host-resident tables with the UVA copy
kernel (interpreted: the whole admission runs on this thread), with and without the
pipeline's prefetch; a library model with jagged lists and a shared table, with and without
host tables and prefetch. The torch kernel path's dedupe syncs and is flagged, and each kind
of op is caught on purpose-made code, so the detector is shown to work.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import hybridrec
from hybridrec import EmbeddingTables, Feature, Table
from hybridrec.distributed import DistEnv, destroy_distributed, init_distributed
from hybridrec.kernels import dispatch, native
from hybridrec.optim import RowWiseAdagrad, SparseAdagrad, SparseAdam, SparseSGD
from hybridrec.planner import CachePolicy
from hybridrec.shard import declarations
from hybridrec.sparse.api import embedding_modules
from hybridrec.sparse.groups import HostOptions
from hybridrec.train.pipeline import TrainPipeline
from hybridrec.train.trainer import Trainer
from hybridrec.types import Batch, KeyedIds
from tests.equivalence import make_cfg
from tests.syncs import HYBRIDREC_ROOT, SyncRecorder, unrecorded_launches

pytest.importorskip("triton")


@pytest.fixture
def interpreted_kernels(monkeypatch):
    """Triton in its CPU interpreter, its launches not recorded."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    unrecorded_launches(monkeypatch)
    yield
    dispatch.set_kernels("auto")


# -- DLRM, all tables on the device ------------------------------------------------------------


def _dlrm_syncs(sparse: str, kernels: str, check_ids: bool = False) -> SyncRecorder:
    cfg = make_cfg("none", sparse, 1)
    cfg.train.check_ids = check_ids
    cfg.train.kernels = kernels
    trainer = Trainer(cfg, DistEnv(device=torch.device("cpu")))
    if check_ids:  # deferred, as on CUDA (on the CPU the checks raise at once: they sync)
        _defer_checks(trainer)
    batches = [trainer.train_batch(s) for s in range(3)]
    trainer.train_step(batches[0])  # warmup, as the GPU test
    with SyncRecorder() as rec:
        for b in batches[1:]:
            trainer.train_step(b)
    return rec


def _defer_checks(trainer: Trainer) -> None:
    for m in trainer.embeddings:
        if m.checker is not None:
            m.checker.defer = True
    for check in trainer.dense_checks.values():
        check.defer = True


@pytest.mark.parametrize("check_ids", [False, True])
@pytest.mark.parametrize("sparse", ["sgd", "rowwise_adagrad", "adam", "adagrad"])
def test_triton_training_step_has_no_syncing_op(interpreted_kernels, sparse, check_ids):
    rec = _dlrm_syncs(sparse, "triton", check_ids)
    assert rec.total > 200  # the whole step was seen (lookup, MLPs, backward, updates)
    assert not rec.syncs, f"ops that make CUDA wait for the device: {rec.unexpected()}"


def test_the_detector_flags_the_torch_path_dedupe(interpreted_kernels):
    with native.disabled():  # the torch ops' dedupe (the C kernels' is one opaque call)
        rec = _dlrm_syncs("sgd", "torch")
    ops = {s.op for s in rec.syncs}
    assert ops & {"aten::_unique2", "aten::unique_consecutive"}, rec.unexpected()


# -- host-resident tables ----------------------------------------------------------------------


def _host_trainer(env: DistEnv, sparse: str) -> Trainer:
    cfg = make_cfg("host", sparse, 1)
    cfg.data.zipf_exponent = 0.3  # many distinct rows: the tiny caches evict every step
    cfg.sharding.cache_fraction = 0.001  # the floor: two batches' ids
    cfg.sharding.host_copy = "kernel"  # interpreted: admission and row moves on this thread
    cfg.train.kernels = "triton"
    trainer = Trainer(cfg, env)
    _defer_checks(trainer)
    return trainer


def _host_syncs(sparse: str, prefetch: bool, steps: int = 5) -> tuple[list, list, int]:
    """Per recorded step: its unexpected syncs and its documented ones; and rows written
    back (the costly path ran)."""
    env = init_distributed("cpu", force_group=True)  # sharding=host wants a process group
    try:
        trainer = _host_trainer(env, sparse)
        batches = [trainer.train_batch(s) for s in range(steps + 2)]
        pipe = trainer.pipeline(iter(batches))
        for _ in range(2):  # warmup: the caches fill
            trainer.train_step(pipe.next(), pipe if prefetch else None)
        unexpected, allowed = [], []
        for s in range(steps):
            more = prefetch and s + 1 < steps
            with SyncRecorder() as rec:
                trainer.train_step(pipe.next(), pipe if more else None)
            assert rec.total > 100  # the whole step was seen
            unexpected.append(rec.unexpected())
            allowed.append(rec.allowed())
        written = trainer.embeddings[0].cache_stats().rows_written
        pipe.close()
    finally:
        destroy_distributed(env)
    return unexpected, allowed, written


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("sparse", ["rowwise_adagrad", "adam"])
def test_a_host_step_syncs_only_at_its_admission(interpreted_kernels, sparse, prefetch):
    """Admission (the lookup's, or the prefetch's of the next batch), the backward's dedupe
    and update into the cache, the lookup of a prefetched batch: one read per step, at the
    admission (two when it evicts unforeseen), nothing else."""
    unexpected, allowed, written = _host_syncs(sparse, prefetch)
    assert written > 0  # evicted dirty rows: the costly path ran
    assert unexpected == [[]] * len(unexpected), unexpected
    # one admission a step, one read each (two when it evicts unforeseen); with prefetch the
    # last step prefetches nothing and looks up what was prefetched: no read at all
    admissions = [step["_admit.tolist"] for step in allowed]
    assert admissions == [1] * (len(allowed) - prefetch) + [0] * prefetch, allowed
    assert all(step["_choose_slots.int"] <= 1 for step in allowed), allowed


# -- a library model: jagged lists, a shared table, two widths -----------------------------


class TwoSided(nn.Module):
    """A user side (a user table shared by a user id and a jagged mean list of friends, and
    an age table; width 8) and an item side (items and a jagged genre list; width 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.users = EmbeddingTables(
            [Table("user", 300, 8), Table("age", 7, 8)],
            [
                Feature("user_id", "user"),
                Feature("friends", "user", hotness=4, jagged=True, pooling="mean"),
                Feature("age", "age"),
            ],
        )
        self.items = EmbeddingTables(
            [Table("item", 2000, 4), Table("genre", 20, 4)],
            [Feature("item_id", "item"), Feature("genres", "genre", hotness=3, jagged=True)],
        )
        self.user_tower = nn.Linear(3 * 8 + 2, 8)
        self.item_tower = nn.Linear(2 * 4, 8)

    def forward(self, dense: torch.Tensor, ids: hybridrec.KeyedIds) -> torch.Tensor:
        u, i = self.users(ids), self.items(ids)
        user = self.user_tower(torch.cat([u["user_id"], u["friends"], u["age"], dense], dim=1))
        return (user * self.item_tower(torch.cat([i["item_id"], i["genres"]], dim=1))).sum(1)


LIBRARY_FEATURES = [("user_id", 1, 300), ("friends", 4, 300), ("age", 1, 7)]
LIBRARY_FEATURES += [("item_id", 1, 2000), ("genres", 3, 20)]
LIBRARY_OPTIMIZERS = {
    "sgd": lambda: SparseSGD(0.5),
    "rowwise_adagrad": lambda: RowWiseAdagrad(0.1),
    "adam": lambda: SparseAdam(0.01),
    "adagrad": lambda: SparseAdagrad(0.1),
}


def _library_batches(n: int, b: int = 32) -> list[Batch]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        cols = []
        for _, h, rows in LIBRARY_FEATURES:
            ids = (torch.rand(b, h, generator=g) ** 2 * rows).long()
            if h > 1:  # a list: 0..h ids, the rest padding
                length = torch.randint(0, h + 1, (b, 1), generator=g)
                ids = ids.masked_fill(torch.arange(h).expand(b, h) >= length, -1)
            cols.append(ids)
        labels = (torch.rand(b, generator=g) < 0.4).float()
        out.append(Batch(torch.randn(b, 2, generator=g), torch.cat(cols, 1), labels))
    return out


def _library_syncs(sharding: str, sparse: str, prefetch: bool, steps: int = 4) -> list:
    """Per recorded step: (its unexpected syncs, its documented ones, whether it staged the
    next batch)."""
    torch.manual_seed(0)
    net = hybridrec.parallelize(
        TwoSided(),
        batch_size=32,
        sparse_optimizer=LIBRARY_OPTIMIZERS[sparse](),
        sharding=sharding,
        cache=CachePolicy(fraction=0.001),  # the floor: two batches' ids
        host=HostOptions(copy="kernel"),
    )
    names, hotness = [n for n, _, _ in LIBRARY_FEATURES], [h for _, h, _ in LIBRARY_FEATURES]
    tables = {id(t.storage): t for t in declarations(net)}
    modules = embedding_modules(net)
    for m in modules:
        m.checker.defer = True  # as on CUDA
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    batches = _library_batches(steps + 2)

    def select(module, ids: torch.Tensor) -> torch.Tensor:  # as the trainer's module_ids
        return tables[id(module)].select(KeyedIds(ids, names, hotness))

    pipe = TrainPipeline(iter(batches), torch.device("cpu"), modules, select)
    out = []
    for s in range(steps + 1):  # as Trainer.train_step, the first step not recorded
        more = prefetch and s < steps
        with SyncRecorder() as rec:
            batch = pipe.next()
            logits = net(batch.dense, KeyedIds(batch.ids, names, hotness))
            loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
            if more:
                pipe.prefetch_next()
            loss.backward()
            opt.step()
            opt.zero_grad()
        if s:  # the first step fills the caches
            out.append((rec.unexpected(), rec.allowed(), more))
    if sharding == "host":
        hosts = [g for m in modules for g in m.host_groups()]
        assert len(hosts) == 2 and sum(g.take_stats().rows_written for g in hosts) > 0
    pipe.close()
    return out


@pytest.mark.parametrize(
    ("sharding", "sparse", "prefetch"),
    [
        ("none", "adam", False),
        ("none", "adagrad", False),
        ("host", "rowwise_adagrad", False),
        ("host", "sgd", True),
        ("host", "adam", True),
    ],
)
def test_a_library_model_step_syncs_only_at_documented_points(
    interpreted_kernels, sharding, sparse, prefetch
):
    """Jagged lists (one of them mean-pooled, sharing its table with a single id) and two
    widths, each collection one group on one rank: per step and collection, one read of a
    list's real ids where its lookup inputs are made (the forward, or the prefetch that
    stages the next batch), and with host tables one admission (the lookup's or the
    prefetch's). Nothing else: not the backward, not the lookup of a prefetched batch."""
    dispatch.set_kernels("triton")
    for unexpected, allowed, staged_next in _library_syncs(sharding, sparse, prefetch):
        assert unexpected == [], unexpected
        made_here = not prefetch or staged_next  # inputs made (and admitted) in this step
        assert allowed["sample_major_inputs.aten::nonzero"] == 2 * made_here, allowed
        assert allowed["_admit.tolist"] == 2 * made_here * (sharding == "host"), allowed
        assert allowed["_choose_slots.int"] <= allowed["_admit.tolist"], allowed


# -- the detector itself ----------------------------------------------------------------------


def test_the_detector_flags_each_kind_of_syncing_op():
    """Each op the module docstring lists is caught, attributed to its line (here via a
    hybridrec-like frame: code compiled under the package's path)."""
    source = """
def run(t, i, mask, rows):
    t[i] = 1.0                       # a Python scalar through a tensor index
    t[mask]                          # boolean mask
    t.nonzero()
    torch.masked_select(t, mask)
    t.sum().item()
    t.tolist()
    bool(t.any())
    torch.repeat_interleave(rows, rows)
    torch.unique(rows)
    t.index_put_((mask,), t[:1])     # index_put with a boolean mask
    t.index_put_((i,), t[0].clone()) # one value through an index (as `t[i] = 1.0` makes)
    t[1:] = 0.0                      # fine: a slice, no tensor index
    t.index_fill_(0, i, 2.0)         # fine: the scalar is a kernel argument
    torch.repeat_interleave(rows, rows, output_size=6)  # fine: the size is given
    t.index_put_((i,), t[:2].clone())  # fine: values from the device
"""
    code = compile(source, str(Path(HYBRIDREC_ROOT) / "probe.py"), "exec")
    scope: dict = {"torch": torch}
    exec(code, scope)
    t = torch.arange(4.0)
    with SyncRecorder() as rec:
        scope["run"](t, torch.tensor([0, 2]), t > 1, torch.tensor([1, 2, 3]))
    assert [s.line for s in rec.syncs] == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], rec.unexpected()
    assert {s.file for s in rec.syncs} == {"probe.py"}
