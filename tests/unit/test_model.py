"""The dense building blocks against their defining formulas, written out with loops."""

from __future__ import annotations

import pytest
import torch

from hybridrec.configure import load_model_config
from hybridrec.model import DLRM, DenseArch, DotInteraction, LowRankCrossNet
from hybridrec.model.mlp import MLP
from hybridrec.model.tables import declared_features
from hybridrec.shard import parallelize
from hybridrec.types import KeyedIds


def test_dot_interaction_matches_pairwise_formula():
    torch.manual_seed(0)
    B, T, D = 5, 4, 3
    bottom, pooled = torch.randn(B, D), torch.randn(B, T, D)
    out = DotInteraction(T)(bottom, pooled)
    vecs = [bottom] + [pooled[:, t] for t in range(T)]
    expected = [bottom]
    for i in range(T + 1):  # strictly lower triangle, row-major: (1,0), (2,0), (2,1), ...
        for j in range(i):
            expected.append((vecs[i] * vecs[j]).sum(1, keepdim=True))
    expected = torch.cat(expected, dim=1)
    assert out.shape == (B, D + (T + 1) * T // 2)
    torch.testing.assert_close(out, expected)


def test_dot_interaction_backward_matches_autograd_of_the_formula():
    """The one-bmm symmetric backward gives autograd's gradients (float64: exact to 1e-12)."""
    torch.manual_seed(0)
    B, T, D = 6, 5, 4
    bottom = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
    pooled = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)
    out = DotInteraction(T)(bottom, pooled)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), [bottom, pooled])

    b2, p2 = bottom.detach().requires_grad_(), pooled.detach().requires_grad_()
    x = torch.cat([b2.unsqueeze(1), p2], dim=1)
    rows, cols = torch.tril_indices(T + 1, T + 1, offset=-1)
    ref = torch.cat([b2, torch.bmm(x, x.transpose(1, 2))[:, rows, cols]], dim=1)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    ref_grads = torch.autograd.grad((ref * w).sum(), [b2, p2])
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_dot_interaction_under_autocast_casts_once_and_returns_fp32_grads():
    """As autocast's bmm would: bf16 dots, and the fp32 pooled input gets an fp32 gradient."""
    torch.manual_seed(0)
    B, T, D = 8, 3, 16
    bottom = torch.randn(B, D).bfloat16().requires_grad_()  # an autocast linear's output
    pooled = torch.randn(B, T, D, requires_grad=True)  # the embeddings' fp32 output
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = DotInteraction(T)(bottom, pooled)
        x = torch.cat([bottom.unsqueeze(1).float(), pooled], dim=1)
        rows, cols = torch.tril_indices(T + 1, T + 1, offset=-1)
        ref = torch.bmm(x, x.transpose(1, 2))[:, rows, cols]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[:, D:], ref, rtol=0, atol=0)
    out.float().sum().backward()
    assert pooled.grad.dtype == torch.float32 and bottom.grad.dtype == torch.bfloat16
    assert pooled.grad.abs().sum() > 0


def test_low_rank_cross_net_matches_formula():
    torch.manual_seed(0)
    net = LowRankCrossNet(in_features=6, num_layers=3, rank=2)
    for u in net.U:
        torch.nn.init.normal_(u.bias)
    x0 = torch.randn(4, 6)
    x = x0
    for v, u in zip(net.V, net.U):
        W_v, W_u, b = v.weight, u.weight, u.bias  # [2, 6], [6, 2], [6]
        x = x0 * (x @ W_v.T @ W_u.T + b) + x
    torch.testing.assert_close(net(x0), x)


def test_low_rank_cross_net_init_is_the_references():
    """torchrec's LowRankCrossNet (the MLPerf DCNv2 reference): U, V xavier_normal_, b = 0."""
    torch.manual_seed(0)
    n, rank = 600, 200
    net = LowRankCrossNet(in_features=n, num_layers=2, rank=rank)
    std = (2.0 / (n + rank)) ** 0.5
    for v, u in zip(net.V, net.U, strict=True):
        assert v.weight.shape == (rank, n) and u.weight.shape == (n, rank)
        for w in (v.weight, u.weight):
            assert abs(float(w.std()) / std - 1) < 0.02 and abs(float(w.mean())) < 0.01 * std
        assert torch.equal(u.bias, torch.zeros(n))


def test_mlp_torch_init_is_nn_linear_default():
    """init="torch": the layers keep nn.Linear's own init, bit for bit (same RNG draws)."""
    torch.manual_seed(3)
    mlp = MLP(13, [64, 32], final_relu=True, init="torch")
    torch.manual_seed(3)
    plain = [torch.nn.Linear(13, 64), torch.nn.Linear(64, 32)]
    linears = [m for m in mlp if isinstance(m, torch.nn.Linear)]
    for got, want in zip(linears, plain, strict=True):
        assert torch.equal(got.weight, want.weight) and torch.equal(got.bias, want.bias)
    with pytest.raises(ValueError, match="MLP init 'xavier' is not one of: dlrm, torch"):
        MLP(4, [2], final_relu=False, init="xavier")


def test_each_arch_initialises_its_mlps_as_its_reference():
    """dlrm: the DLRM reference's init (unchanged); dcnv2: torchrec's DLRM_DCN (nn.Linear's
    default), with the cross network between bottom and top as DenseArch builds them."""
    for arch, init in (("dlrm", "dlrm"), ("dcnv2", "torch")):
        cfg = load_model_config("dlrm_tiny")
        cfg.arch = arch
        torch.manual_seed(5)
        dense = DenseArch(cfg)
        torch.manual_seed(5)
        bottom = MLP(cfg.num_dense_features, cfg.bottom_mlp, final_relu=True, init=init)
        if arch == "dcnv2":
            top_in = cfg.bottom_mlp[-1] + sum(cfg.dims())
            LowRankCrossNet(top_in, cfg.dcn_layers, cfg.dcn_rank)
        else:
            top_in = DotInteraction(len(cfg.num_embeddings_per_feature)).output_dim(
                cfg.bottom_mlp[-1]
            )
        top = MLP(top_in, cfg.top_mlp, final_relu=False, init=init)
        want = {f"bottom.{k}": v for k, v in bottom.state_dict().items()}
        want |= {f"top.{k}": v for k, v in top.state_dict().items()}
        got = dense.state_dict()
        for k, v in want.items():
            assert torch.equal(got[k], v), (arch, k)


def _dlrm(cfg) -> DLRM:
    """DLRM with its tables in this process (rows not trained: no sparse optimizer)."""
    return parallelize(DLRM(cfg), batch_size=7, sparse_optimizer=None, sharding="none")


def test_dlrm_and_dcnv2_forward_shapes_and_grads():
    for arch in ("dlrm", "dcnv2"):
        cfg = load_model_config("dlrm_tiny")
        cfg.arch = arch
        model = _dlrm(cfg)
        dense = torch.randn(7, 13)
        ids = torch.stack([torch.randint(0, t.num_rows, (7,)) for t in cfg.tables()], dim=1)
        names = [t.name for t in cfg.tables()]
        logits = model(dense, KeyedIds(ids, names, [1] * len(names)))
        assert logits.shape == (7,)
        torch.testing.assert_close(model(dense, ids), logits)  # all columns, in order: the same
        logits.sum().backward()
        assert all(p.grad is not None for p in model.parameters())


def test_dlrm_declares_its_tables_with_their_plain_names():
    cfg = load_model_config("dlrm_tiny")
    model = DLRM(cfg)
    assert [f.name for f in declared_features(model)] == [t.name for t in cfg.tables()]
    assert model.embeddings.autocast_output  # the dot interaction casts them first
    model = _dlrm(cfg)
    # embedding weights are buffers: neither DDP nor the dense optimizer may see them
    assert list(model.embeddings.parameters()) == []
    assert sum(b.numel() for b in model.embeddings.buffers()) >= sum(
        t.num_rows * t.dim for t in cfg.tables()
    )
    with pytest.raises(ValueError, match="parallelized already"):  # re-init would lose rows
        parallelize(model, batch_size=7, sparse_optimizer=None, sharding="none")


def test_the_benchmark_baselines_textbook_interaction_is_the_same_function():
    """benchmarks/baseline.py's plain DLRM uses the reference's interaction: same forward
    bits as hybridrec's, gradients equal to float round-off."""
    from benchmarks.baseline import TextbookDotInteraction

    torch.manual_seed(0)
    bottom, pooled = (
        torch.randn(16, 8, requires_grad=True),
        torch.randn(16, 5, 8, requires_grad=True),
    )
    ours, ref = DotInteraction(5)(bottom, pooled), TextbookDotInteraction(5)(bottom, pooled)
    assert torch.equal(ours, ref)
    w = torch.randn_like(ours)
    g1 = torch.autograd.grad((ours * w).sum(), [bottom, pooled])
    g2 = torch.autograd.grad((ref * w).sum(), [bottom, pooled])
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_model_init_dlrm_keeps_dcnv2s_earlier_initialisation():
    """model.init=dlrm: DLRM's MLP init and nn.Linear's default cross layers (what DCNv2 had
    before it took the MLPerf reference's; the MovieLens preset chose it on val)."""
    cfg = load_model_config("dlrm_tiny")
    cfg.arch, cfg.init = "dcnv2", "dlrm"
    torch.manual_seed(5)
    dense = DenseArch(cfg)
    torch.manual_seed(5)
    bottom = MLP(cfg.num_dense_features, cfg.bottom_mlp, final_relu=True, init="dlrm")
    top_in = cfg.bottom_mlp[-1] + sum(cfg.dims())
    cross = LowRankCrossNet(top_in, cfg.dcn_layers, cfg.dcn_rank, xavier=False)
    top = MLP(top_in, cfg.top_mlp, final_relu=False, init="dlrm")
    torch.manual_seed(5)
    MLP(cfg.num_dense_features, cfg.bottom_mlp, final_relu=True, init="dlrm")
    plain = [torch.nn.Linear(top_in, cfg.dcn_rank, bias=False) for _ in range(cfg.dcn_layers)]
    for got, want in zip(cross.V, plain, strict=True):
        assert torch.equal(got.weight, want.weight)  # V: nn.Linear's own draws, untouched
    want = {f"bottom.{k}": v for k, v in bottom.state_dict().items()}
    want |= {f"interaction.{k}": v for k, v in cross.state_dict().items()}
    want |= {f"top.{k}": v for k, v in top.state_dict().items()}
    got = dense.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
