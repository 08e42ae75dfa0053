"""Fused lookup and row optimizers against torch: nn.EmbeddingBag and torch.optim.

Each sparse optimizer is checked after several steps on the rows a batch touches:
- SGD vs torch.optim.SGD on an nn.EmbeddingBag(sparse=True): same math, tight tolerance.
- Adam vs torch.optim.SparseAdam (lazy Adam, global step count) in its eps form "sparse_adam":
  same math (the default form against torch.optim.Adam: tests/unit/test_adam_eps.py).
- row-wise Adagrad vs torch.optim.Adagrad when every entry of a row's gradient is equal
  (then the row mean of g^2 equals each g_i^2 and the two coincide).
- element-wise Adagrad vs torch.optim.Adagrad on the dense gradient of the whole table: rows
  a batch does not touch get g = 0, which leaves their sum and weight unchanged, so every row
  and every accumulator must agree.
Tolerances are float32 round-off (the sums run in a different order than torch's kernels).
"""

from __future__ import annotations

import pytest
import torch

from hybridrec.config import SparseOptimConfig
from hybridrec.optim import (
    SPARSE_OPTIMIZERS,
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseSGD,
    build_sparse_optimizer,
)
from hybridrec.planner import OptimizerFootprint
from hybridrec.sparse import EmbeddingCollection, IdOutOfRangeError
from hybridrec.sparse.bags import regular_bags
from hybridrec.sparse.exchange.sample_major import SampleMajor
from hybridrec.sparse.fused import FusedEmbedding, LookupInput
from hybridrec.sparse.init import init_shard
from hybridrec.sparse.layout import GroupKey, Placement, full_shard
from hybridrec.types import Pooling, ShardSpec, StateKind, TableConfig
from tests.equivalence import make_cfg

TABLE = TableConfig("t", num_rows=50, dim=8, hotness=3)


def _pair(opt, ref_opt_factory, pooling=Pooling.SUM, sparse=True):
    table = TableConfig("t", 50, 8, 3, pooling)
    fused = FusedEmbedding([(table, 0, full_shard(table))], opt, seed=1)
    ref = torch.nn.EmbeddingBag(50, 8, mode=pooling.value, sparse=sparse)
    with torch.no_grad():
        ref.weight.copy_(fused.weight)
    return table, fused, ref, ref_opt_factory(ref.parameters())


def _run(fused, ref, ref_opt, table, coeff_fn, steps=4):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, 20, (6, table.hotness), generator=g)  # rows 20.. never touched
        coeff = coeff_fn(g)
        out = fused(
            [
                LookupInput(
                    ids.reshape(-1),
                    regular_bags(6, 3, ids.device),
                    6,
                    1 / 3 if table.pooling == Pooling.MEAN else 1.0,
                )
            ]
        )[0]
        (out * coeff).sum().backward()
        ref_out = ref(ids)
        torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
        ref_opt.zero_grad()
        (ref_out * coeff).sum().backward()
        ref_opt.step()
    torch.testing.assert_close(fused.weight, ref.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.weight[20:], ref.weight.detach()[20:], rtol=0, atol=0)


@pytest.mark.parametrize("pooling", [Pooling.SUM, Pooling.MEAN])
def test_sgd_matches_torch(pooling):
    table, fused, ref, ref_opt = _pair(
        SparseSGD(0.3), lambda p: torch.optim.SGD(p, lr=0.3), pooling
    )
    _run(fused, ref, ref_opt, table, lambda g: torch.randn(6, 8, generator=g))


def test_adam_matches_sparse_adam():
    table, fused, ref, ref_opt = _pair(
        SparseAdam(0.01, 0.8, 0.95, 1e-6, eps_form="sparse_adam"),
        lambda p: torch.optim.SparseAdam(list(p), lr=0.01, betas=(0.8, 0.95), eps=1e-6),
    )
    _run(fused, ref, ref_opt, table, lambda g: torch.randn(6, 8, generator=g))
    assert fused.step_count == 4


def test_rowwise_adagrad_matches_adagrad_for_equal_entries():
    table, fused, ref, ref_opt = _pair(
        RowWiseAdagrad(0.1, 1e-10), lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10)
    )
    # one coefficient per bag, same across columns: every row's gradient has equal entries
    _run(fused, ref, ref_opt, table, lambda g: torch.randn(6, 1, generator=g).expand(6, 8))


@pytest.mark.parametrize("pooling", [Pooling.SUM, Pooling.MEAN])
def test_adagrad_matches_torch_adagrad_on_the_dense_table(pooling):
    """Element-wise Adagrad on the touched rows equals torch.optim.Adagrad (defaults: no lr
    decay, accumulators from 0, eps 1e-10) stepping on the dense gradient of the whole table,
    over steps whose bags repeat ids: weights and accumulators, all rows."""
    table, fused, ref, ref_opt = _pair(
        SparseAdagrad(0.1), lambda p: torch.optim.Adagrad(p, lr=0.1), pooling, sparse=False
    )
    _run(fused, ref, ref_opt, table, lambda g: torch.randn(6, 8, generator=g), steps=5)
    ref_sum = ref_opt.state[ref.weight]["sum"]
    assert fused.state()["sum"].shape == (50, 8)
    torch.testing.assert_close(fused.state()["sum"], ref_sum, rtol=1e-5, atol=1e-7)
    assert torch.equal(fused.state()["sum"][20:], torch.zeros(30, 8))  # never touched


def test_adagrad_is_built_from_the_config_with_its_eps():
    opt = build_sparse_optimizer(SparseOptimConfig(name="adagrad", lr=0.01, eps=1e-8))
    assert isinstance(opt, SparseAdagrad) and (opt.lr, opt.eps) == (0.01, 1e-8)
    assert not opt.needs_full_row_stat  # column shards need nothing shared
    assert SparseAdagrad(0.1).eps == torch.optim.Adagrad([torch.zeros(1)]).defaults["eps"]


@pytest.mark.parametrize("width", [8, 1])
@pytest.mark.parametrize("name", SPARSE_OPTIMIZERS)
def test_state_bytes_are_the_planners_footprint(name, width):
    """The planner sizes each optimizer's state as the groups allocate it: row-wise state
    [R], element-wise state [R, D] (also for D = 1)."""
    table = TableConfig("t", 50, width)
    opt = build_sparse_optimizer(SparseOptimConfig(name=name))
    fused = FusedEmbedding([(table, 0, full_shard(table))], opt)
    for state_name, kind in opt.state_spec().items():
        want = (50,) if kind == StateKind.ROW else (50, width)
        assert fused.state()[state_name].shape == want, state_name
    state_bytes = sum(t.numel() * t.element_size() for t in fused.state().values())
    assert state_bytes == OptimizerFootprint.for_optimizer(name).bytes_for(50, width)


# Each sparse optimizer and its torch.optim twin on a table of width 1, where row-wise
# Adagrad's mean of g^2 over the row is g^2: torch's Adagrad. Adam is lazy: SparseAdam.
WIDTH_ONE = {
    "sgd": (lambda: SparseSGD(0.3), lambda p: torch.optim.SGD(p, lr=0.3)),
    "rowwise_adagrad": (
        lambda: RowWiseAdagrad(0.5, 1e-8),
        lambda p: torch.optim.Adagrad(p, lr=0.5, eps=1e-8),
    ),
    "adam": (
        lambda: SparseAdam(0.05, eps_form="sparse_adam"),
        lambda p: torch.optim.SparseAdam(p, lr=0.05),
    ),
    "adagrad": (lambda: SparseAdagrad(0.5), lambda p: torch.optim.Adagrad(p, lr=0.5)),
}


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("opt", list(WIDTH_ONE))
def test_every_optimizer_trains_a_table_of_width_one(opt, kernels, monkeypatch):
    """Width-1 tables (the wide part of a Wide & Deep model) train with every optimizer as
    torch.optim does: weights and state after multi-hot steps with repeated ids; element-wise
    state is [R, 1] like the weight, row-wise state [R]; untouched rows stay as they were."""
    from hybridrec.kernels import dispatch

    if kernels == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    make, make_ref = WIDTH_ONE[opt]
    table = TableConfig("t", 10, 1, hotness=2)
    fused = FusedEmbedding([(table, 0, full_shard(table))], make(), seed=1)
    ref = torch.nn.Parameter(fused.weight.clone())
    ref_opt = make_ref([ref])
    g = torch.Generator().manual_seed(0)
    with dispatch.use_kernels(kernels):
        assert dispatch.available(fused.weight) == (kernels == "triton")
        for _ in range(3):
            ids = torch.randint(0, 6, (4, 2), generator=g)  # repeats; rows 6.. never touched
            coeff = torch.randn(4, 1, generator=g)
            out = fused([LookupInput(ids.reshape(-1), regular_bags(4, 2, ids.device), 4)])[0]
            (out * coeff).sum().backward()
            ref_opt.zero_grad()
            ref_out = torch.nn.functional.embedding_bag(ids, ref, mode="sum", sparse=opt == "adam")
            (ref_out * coeff).sum().backward()
            ref_opt.step()
    torch.testing.assert_close(fused.weight, ref.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(fused.weight[6:], ref.detach()[6:])
    ref_state = {k: v for k, v in ref_opt.state[ref].items() if k != "step"}
    assert set(fused.state()) == set(ref_state)
    for name, value in fused.state().items():
        assert value.shape == ((10,) if opt == "rowwise_adagrad" else (10, 1)), name
        want = ref_state[name].view(value.shape)
        torch.testing.assert_close(value, want, rtol=1e-6, atol=1e-7, msg=name)


def test_rowwise_adagrad_state_is_one_float_per_row():
    table = TableConfig("t", 50, 8)
    fused = FusedEmbedding([(table, 0, full_shard(table))], RowWiseAdagrad(0.1))
    assert fused.state()["sum"].shape == (50,)
    adam = FusedEmbedding([(table, 0, full_shard(table))], SparseAdam(0.1))
    assert adam.state()["exp_avg"].shape == (50, 8)


def test_fused_group_serves_several_tables_in_one_weight():
    tables = [TableConfig("a", 10, 4, 2), TableConfig("b", 7, 4, 1)]
    coll = EmbeddingCollection(tables, SparseSGD(0.1), seed=3)
    assert len(coll.groups) == 1
    group = next(iter(coll.groups.values())).store
    assert group.weight.shape == (17, 4)
    ids = torch.tensor([[1, 9, 6], [0, 0, 0]])
    out = coll(ids)
    w = group.weight
    torch.testing.assert_close(out[:, 0], torch.stack([w[1] + w[9], w[0] + w[0]]))
    torch.testing.assert_close(out[:, 1], torch.stack([w[10 + 6], w[10 + 0]]))


def test_init_is_independent_of_sharding():
    table = TableConfig("t", 200_000, 6)  # spans several init chunks
    full = init_shard(table, 3, full_shard(table), seed=5, dtype=torch.float32)
    piece = init_shard(table, 3, ShardSpec("t", 1, 65_000, 140_000, 2, 5), 5, torch.float32)
    torch.testing.assert_close(piece, full[65_000:140_000, 2:5], rtol=0, atol=0)
    assert full.abs().max() <= 1 / 200_000**0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parallel_init_of_a_big_shard_equals_serial_init(monkeypatch, dtype):
    """Past two chunks (131,072 rows) chunks are generated on a thread pool, in place for
    full-width fp32 shards: the same values as one thread, and as slices of the table."""
    import hybridrec.sparse.init as init_mod

    t = TableConfig("big", num_rows=300_001, dim=12)
    shards = [
        ShardSpec("big", 0, 0, 300_001, 0, 12),
        ShardSpec("big", 0, 65_000, 280_000, 0, 12),  # partial first and last chunks
        ShardSpec("big", 0, 1, 300_000, 4, 10),  # a column shard
    ]
    parallel = [init_shard(t, 2, s, 5, dtype) for s in shards]
    monkeypatch.setattr(init_mod.os, "cpu_count", lambda: 1)
    serial = [init_shard(t, 2, s, 5, dtype) for s in shards]
    for p, s in zip(parallel, serial, strict=True):
        assert torch.equal(p, s)
    full = parallel[0]
    assert torch.equal(parallel[1], full[65_000:280_000])
    assert torch.equal(parallel[2], full[1:300_000, 4:10])


def test_out_of_range_id_names_feature_id_and_table_size():
    tables = [TableConfig("cat_0", 10, 4), TableConfig("cat_1", 5, 4)]
    coll = EmbeddingCollection(tables, SparseSGD(0.1))
    with pytest.raises(IdOutOfRangeError, match=r"feature 1 \(cat_1\): id 5 at sample 1 .* 5 rows"):
        coll(torch.tensor([[0, 0], [9, 5]]))
    with pytest.raises(IdOutOfRangeError, match="id -1"):
        coll(torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match=r"ids must be \[batch, 2\]"):
        coll(torch.tensor([[0, 0, 0]]))
    EmbeddingCollection(tables, SparseSGD(0.1), check_ids=False)(torch.tensor([[9, 4]]))


def test_no_update_without_grad():
    coll = EmbeddingCollection([TableConfig("a", 10, 4)], SparseSGD(0.1))
    key = GroupKey(Placement.DEVICE, 4)
    before = coll.groups[key].store.weight.clone()
    with torch.no_grad():
        coll(torch.tensor([[1], [2]]))
    assert torch.equal(before, coll.groups[key].store.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tables_round_once_with_fp32_math(dtype):
    table = TableConfig("t", 30, 8)
    g = FusedEmbedding([(table, 0, full_shard(table))], RowWiseAdagrad(0.1), seed=2, dtype=dtype)
    assert g.weight.dtype == dtype and g.state()["sum"].dtype == torch.float32
    before = g.weight.clone()
    ids = torch.tensor([3, 3, 7])
    out = g([LookupInput(ids, torch.tensor([0, 1, 2]), 3)])[0]
    assert out.dtype == torch.float32  # pooled in fp32
    coeff = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    (out * coeff).sum().backward()
    grads = torch.stack([coeff[0] + coeff[1], coeff[2]])  # rows 3 and 7
    s = grads.pow(2).mean(1)
    expected = (before[[3, 7]].float() - 0.1 * grads / (s.sqrt() + 1e-8).unsqueeze(1)).to(dtype)
    assert torch.equal(g.weight[[3, 7]], expected)
    untouched = [i for i in range(30) if i not in (3, 7)]
    assert torch.equal(g.weight[untouched], before[untouched])


@pytest.mark.parametrize("width", [8, 1])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad", "adam", "adagrad"])
def test_sample_major_lookup_equals_per_table_lookup(kernels, opt, width, monkeypatch):
    """One group of every table numbers its bags sample-major and returns [B, T, D] without a
    stack (nor a cat in the backward); it must give what the per-table path gives, bit for
    bit: pooled values, and weights and state after updates (multi-hot, mean and sum; tables
    of width 8 and of width 1)."""
    from hybridrec.kernels import dispatch

    if kernels == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch.set_kernels(kernels)
    tables = [
        TableConfig("a", 30, width, hotness=2, pooling=Pooling.MEAN),
        TableConfig("b", 7, width),
        TableConfig("c", 50, width, hotness=3),
    ]
    make = {
        "sgd": lambda: SparseSGD(0.3),
        "rowwise_adagrad": lambda: RowWiseAdagrad(0.2),
        "adam": lambda: SparseAdam(0.05),
        "adagrad": lambda: SparseAdagrad(0.2),
    }[opt]
    fast = EmbeddingCollection(tables, make(), seed=3)
    slow = EmbeddingCollection(tables, make(), seed=3)
    assert isinstance(fast.exchange, SampleMajor)
    slow.exchange = slow.all_to_all  # the per-unit numbering: reassembled by a stack
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(3):
            ids = torch.cat(
                [torch.randint(0, t.num_rows, (5, t.hotness), generator=g) for t in tables], 1
            )
            coeff = torch.randn(5, 3, width, generator=g)
            a, b = fast(ids), slow(ids)
            assert a.shape == (5, 3, width) and a.is_contiguous()
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            (a * coeff).sum().backward()
            (b * coeff).sum().backward()
        for (spec, w, st), (_, w2, st2) in zip(fast.shard_views(), slow.shard_views(), strict=True):
            torch.testing.assert_close(w, w2, rtol=0, atol=0, msg=spec.table)
            for k in st:
                torch.testing.assert_close(st[k], st2[k], rtol=0, atol=0)
    finally:
        dispatch.set_kernels("auto")


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad"])
def test_autocast_output_trains_bit_for_bit_like_fp32_output(kernels, opt, monkeypatch):
    """DLRM under bf16 autocast: the lookup handing over bf16 pooled embeddings (and taking a
    bf16 gradient) trains exactly like fp32 pooled embeddings that the dot interaction casts:
    same losses, same tables and optimizer state, same dense weights (CPU autocast here)."""
    from hybridrec.distributed import DistEnv
    from hybridrec.kernels import dispatch
    from hybridrec.train.trainer import Trainer

    if kernels == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = make_cfg("none", opt, 1, pooling="mean")  # multi-hot: hotness [1, 2, 1, 3, 1]
    cfg.train.kernels = kernels

    def run(autocast_output: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        trainer = Trainer(cfg, DistEnv(device=torch.device("cpu")))
        trainer.autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        trainer.embeddings[0].autocast_output = autocast_output
        with trainer.autocast:
            pooled = trainer.embeddings[0](trainer.train_batch(0).ids)
        assert pooled.dtype == (torch.bfloat16 if autocast_output else torch.float32)
        losses = [trainer.train_step(trainer.train_batch(s)) for s in range(3)]
        views = trainer.embeddings[0].shard_views()
        state = [t.clone() for _, w, st in views for t in (w, *st.values())]
        return losses, state + [p.detach().clone() for p in trainer.model.parameters()]

    try:
        ref_losses, ref_state = run(False)
        losses, state = run(True)
    finally:
        dispatch.set_kernels("auto")
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    for a, b in zip(state, ref_state, strict=True):
        assert torch.equal(a, b)


def test_tables_of_several_widths_keep_the_per_table_path():
    tables = [TableConfig("a", 10, 8), TableConfig("b", 10, 4)]
    assert not isinstance(EmbeddingCollection(tables, SparseSGD(0.1)).exchange, SampleMajor)


def test_deferred_id_check_reads_bad_ids_as_zero_and_raises_later():
    """On CUDA the check would sync every step: it is deferred (forced here on the CPU). Bad
    ids read as row 0 before any kernel touches memory; the error, with the same details,
    comes at the next check (the trainer's logging step, evaluation or checkpoint)."""
    tables = [TableConfig("cat_0", 10, 4), TableConfig("cat_1", 5, 4)]
    coll = EmbeddingCollection(tables, None, check_ids=True)
    coll.checker.defer = True
    coll.check_inputs()  # nothing recorded: no error
    good = coll(torch.tensor([[0, 0], [9, 0], [3, 0]]))
    bad = coll(torch.tensor([[0, 0], [9, 5], [3, -2]]))  # two bad ids: the first is named
    torch.testing.assert_close(bad, good, rtol=0, atol=0)
    coll(torch.tensor([[1, 1]]))  # later batches do not overwrite the first record
    with pytest.raises(IdOutOfRangeError, match=r"feature 1 \(cat_1\): id 5 at sample 1 .*5 rows"):
        coll.check_inputs()
    coll.check_inputs()  # reported once


def test_deferred_check_in_training_stops_before_a_checkpoint(tmp_path):
    from hybridrec.distributed import init_distributed
    from hybridrec.train.checkpoint import list_checkpoints
    from hybridrec.train.trainer import Trainer

    cfg = make_cfg("none", "sgd", 1)
    cfg.checkpoint.dir = str(tmp_path)
    trainer = Trainer(cfg, init_distributed("cpu"))
    trainer.embeddings[0].checker.defer = True
    batch = trainer.train_batch(0)
    batch.ids[7, 3] = 10**6  # cat_2's column
    trainer.train_step(batch)  # no error yet: no sync in the step
    with pytest.raises(IdOutOfRangeError, match="id 1000000 at sample 7"):
        trainer.save()
    assert list_checkpoints(tmp_path) == []


def test_bf16_handoff_only_for_the_dot_interaction():
    """DCNv2 uses the fp32 pooled embeddings in elementwise ops: no bf16 hand-off there. The
    model declares it (EmbeddingTables(autocast_output=...)); nothing is set from outside."""
    from hybridrec.builder import build
    from hybridrec.distributed import DistEnv
    from hybridrec.sparse.api import embedding_modules

    cfg = make_cfg("none", "sgd", 1)
    model, _ = build(cfg, DistEnv(device=torch.device("cpu")))
    assert model.embeddings.autocast_output and embedding_modules(model)[0].autocast_output
    cfg.model.arch = "dcnv2"
    model, _ = build(cfg, DistEnv(device=torch.device("cpu")))
    [storage] = embedding_modules(model)
    assert not model.embeddings.autocast_output and not storage.autocast_output
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert storage(torch.zeros(2, 8, dtype=torch.int64)).dtype == torch.float32
