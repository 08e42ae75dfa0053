"""The bf16 hand-off across ranks: under bf16 autocast, DLRM's sharded output dist carries the
pooled embeddings and their gradients in bf16, and training is bit-for-bit what it is with
fp32 on the wire, at half the bytes.

Why exact: the dot interaction rounds the pooled embeddings to bf16 before any other use, so
rounding them before the exchange instead changes nothing; their gradients come out of the
interaction in bf16; and the 1/W gradient scale, which the fp32 path applies before the
backward exchange, is applied after it, in fp32: the same products. Only whole pooled values
may cross in bf16: row-wise partial sums must be added in fp32 first, so plans that split a
table by rows keep fp32 on the wire (checked here too).

CPU autocast on gloo ranks stands in for CUDA autocast on NCCL (same dtypes and rounding).
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.distributed import DistEnv
from hybridrec.distributed.comm import CommStats
from hybridrec.train.trainer import Trainer
from tests.distributed.harness import spawn_jobs
from tests.equivalence import make_cfg, snapshot

# the module's tests share one module-scoped fixture: one test worker runs them all, so it
# is built once (scripts/test.sh: pytest-xdist --dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed/test_handoff")]
STEPS = 3


def _train(env: DistEnv, mode: str, sparse: str, handoff: bool) -> dict:
    cfg = make_cfg(mode, sparse, env.world_size)
    trainer = Trainer(cfg, env)
    trainer.autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    emb = trainer.embeddings[0]
    emb.autocast_output, emb.stats = handoff, CommStats()
    with trainer.autocast:
        wire = emb.handoff_dtype(torch.device("cpu"))
    losses = [trainer.global_mean(trainer.train_step(trainer.train_batch(s))) for s in range(STEPS)]
    sent = emb.stats.sent["output_dist"] + emb.stats.sent["output_dist.backward"]
    return {
        "losses": losses,
        "wire": wire,
        "whole": emb.layout.whole_values,
        "sent": sent,
        **snapshot(trainer),
    }


def _both(env: DistEnv, mode: str, sparse: str) -> dict:
    torch.set_num_threads(1)
    return {h: _train(env, mode, sparse, h) for h in (False, True)}


CASES = [
    ("table_wise", "sgd", 3),
    ("column_wise", "rowwise_adagrad", 2),  # column shards share row statistics
    ("column_wise", "rowwise_adagrad", 3),  # 1/3 is not a power of two
    ("data_parallel", "adam", 3),  # replicated tables only: their gradients are scaled too
    ("auto", "sgd", 3),  # a mixed plan
    ("row_wise", "sgd", 2),  # partial sums: fp32 on the wire
    ("host", "rowwise_adagrad", 1),  # one rank, host tables behind a device cache
]


@pytest.fixture(scope="module")
def runs() -> dict:
    """Every case's per-rank results, the cases of one world size in one spawn."""
    out = {}
    for world in sorted({w for _, _, w in CASES}):
        jobs = [(f"{m} {s} W={w}", _both, (m, s)) for m, s, w in CASES if w == world]
        out.update(spawn_jobs(world, jobs))
    return out


@pytest.mark.parametrize(("mode", "sparse", "world"), CASES)
def test_bf16_handoff_trains_bit_for_bit_at_half_the_bytes(runs, mode, sparse, world):
    for rank, res in enumerate(runs[f"{mode} {sparse} W={world}"]):
        fp32, half = res[False], res[True]
        label = f"{mode} {sparse} rank {rank}/{world}"
        assert fp32["wire"] is None
        whole = half["whole"]
        assert half["wire"] == (torch.bfloat16 if whole else None), label
        if mode != "auto":  # auto's plan decides (here: replicated, whole and column-split)
            assert whole == (mode != "row_wise"), label  # host on one rank: whole tables
        if fp32["sent"]:
            assert half["sent"] * (2 if whole else 1) == fp32["sent"], label
        assert half["losses"] == fp32["losses"], label
        for (spec, w, st), (_, w2, st2) in zip(half["shards"], fp32["shards"], strict=True):
            assert torch.equal(w, w2), f"{label}: {spec}"
            for k in st:
                assert torch.equal(st[k], st2[k]), f"{label}: {spec} {k}"
        for k, v in half["dense"].items():
            assert torch.equal(v, fp32["dense"][k]), f"{label}: dense {k}"


def test_the_plan_table_counts_the_bf16_wire_where_it_will_be_used():
    """On CUDA under bf16 autocast a DLRM plan without row splits exchanges bf16: the plan
    table's output-dist bytes halve; on the CPU, for DCNv2 or with row splits they do not."""
    from hybridrec.builder import make_plan
    from hybridrec.model.registry import build_model
    from hybridrec.shard import declarations, wire_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device objects only: no GPU needed
    bf16, fp32 = torch.bfloat16, torch.float32

    def wire(cfg, device, autocast=bf16):
        tables = declarations(build_model(cfg.model))
        return wire_dtype(make_plan(cfg, 2), tables, fp32, autocast, device)

    cfg = make_cfg("table_wise", "sgd", 2)
    assert wire(cfg, cuda) == bf16 and wire(cfg, cpu) == fp32
    assert wire(cfg, cuda, autocast=None) == fp32
    assert wire(make_cfg("row_wise", "sgd", 2), cuda) == fp32  # partial sums stay fp32
    cfg.model.arch = "dcnv2"
    assert wire(cfg, cuda) == fp32
