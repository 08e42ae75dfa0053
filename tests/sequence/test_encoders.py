"""The sequence encoders (hybridrec.model.sasrec.SASRec, hybridrec.model.hstu.HSTU): shapes,
causality, padding (masked keys, invariance to trailing PAD), determinism, and each against
an independent computation of its layer."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hybridrec.model.hstu import HSTU
from hybridrec.model.sasrec import SASRec, position_ids

D, MAX_LEN = 8, 12
ENCODERS = {
    "sasrec": lambda **kw: SASRec(D, MAX_LEN, blocks=2, heads=2, dropout=0.3, **kw),
    "sasrec_from_start": lambda **kw: SASRec(
        D, MAX_LEN, blocks=2, heads=2, dropout=0.3, positions="from_start", **kw
    ),
    "hstu": lambda **kw: HSTU(D, MAX_LEN, blocks=2, heads=2, dropout=0.3, **kw),
    "hstu_no_norm": lambda **kw: HSTU(D, MAX_LEN, blocks=2, heads=2, output_norm="none", **kw),
}
EXACT = {"rtol": 0.0, "atol": 1e-6}


def batch(lengths: list[int], width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [B, width, D] (zeros at PAD) and mask [B, width]."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)
    rows = torch.randn(len(lengths), width, D, generator=g) * mask.unsqueeze(-1)
    return rows, mask


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ENCODERS[name]().eval()


@pytest.mark.parametrize("name", ENCODERS)
def test_shapes_and_pad_outputs_are_zeros(name):
    rows, mask = batch([5, 1, 7, 3], 7)
    hidden = build(name)(rows, mask)
    assert hidden.shape == rows.shape
    assert torch.isfinite(hidden).all()
    assert (hidden[~mask] == 0).all()
    assert hidden[mask].abs().sum(-1).min() > 0


@pytest.mark.parametrize("name", ENCODERS)
def test_causal_a_later_event_never_changes_earlier_outputs(name):
    model = build(name)
    rows, mask = batch([7, 6], 7)
    before = model(rows, mask)
    changed = rows.clone()
    changed[:, 4] = torch.randn(2, D)
    after = model(changed, mask)
    torch.testing.assert_close(after[:, :4], before[:, :4], **EXACT)
    assert (after[:, 4] - before[:, 4]).abs().max() > 1e-3  # the change is seen from there


@pytest.mark.parametrize("name", ENCODERS)
def test_trailing_pad_changes_nothing_and_pad_rows_are_never_read(name):
    model = build(name)
    rows, mask = batch([5, 2, 7], 7)
    before = model(rows, mask)
    # three more PAD positions whose rows hold garbage: keys past a length are masked
    wider = torch.cat([rows, torch.randn(3, 3, D)], dim=1)
    wider[~torch.cat([mask, torch.zeros(3, 3, dtype=torch.bool)], 1)] = torch.randn(1, D)
    after = model(wider, torch.cat([mask, torch.zeros(3, 3, dtype=torch.bool)], dim=1))
    torch.testing.assert_close(after[:, :7][mask], before[mask], **EXACT)


@pytest.mark.parametrize("name", ENCODERS)
def test_a_row_is_independent_of_the_others_in_its_batch(name):
    model = build(name)
    rows, mask = batch([5, 2, 7], 7)
    alone = model(rows[1:2], mask[1:2])
    torch.testing.assert_close(model(rows, mask)[1:2], alone, **EXACT)


@pytest.mark.parametrize("name", ENCODERS)
def test_an_empty_history_gives_zeros_not_nan(name):
    rows, mask = batch([0, 3], 4)
    hidden = build(name)(rows, mask)
    assert torch.isfinite(hidden).all() and (hidden[0] == 0).all()


@pytest.mark.parametrize("name", ENCODERS)
def test_seeded_models_and_dropout_are_deterministic(name):
    rows, mask = batch([5, 3], 6)
    a, b = build(name, seed=4).train(), build(name, seed=4).train()
    torch.manual_seed(9)
    out_a = a(rows, mask)
    torch.manual_seed(9)
    torch.testing.assert_close(b(rows, mask), out_a, rtol=0, atol=0)
    c = build(name, seed=5)
    assert not torch.equal(c.eval()(rows, mask), a.eval()(rows, mask))


@pytest.mark.parametrize("name", ENCODERS)
def test_gradients_reach_every_parameter_and_no_pad_row(name):
    model = build(name).train()
    rows, mask = batch([5, 3], 6)
    rows.requires_grad_(True)
    model(rows, mask).sum().backward()
    assert (rows.grad[~mask] == 0).all()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", ENCODERS)
def test_bad_inputs_are_refused_in_one_line(name):
    model = build(name)
    rows, mask = batch([3], MAX_LEN + 1)
    with pytest.raises(ValueError, match=f"exceed max_len={MAX_LEN}; keep the most recent"):
        model(rows, mask)
    with pytest.raises(ValueError, match=r"a bool mask \[B, L\]"):
        model(rows[:, :4], mask[:, :4].float())


def test_positions_from_end_put_the_last_event_at_the_last_position():
    mask = torch.arange(5) < torch.tensor([[5], [2], [1]])
    ids = position_ids(mask, 8, "from_end")
    assert ids[0].tolist() == [3, 4, 5, 6, 7]
    assert ids[1, :2].tolist() == [6, 7] and ids[2, 0] == 7
    assert position_ids(mask, 8, "from_start")[1].tolist() == [0, 1, 2, 3, 4]


def sasrec_reference(model: SASRec, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SASRec in eval mode through torch.nn.MultiheadAttention (the original code's layer)
    with the same weights, one row at a time on its events only."""
    out = torch.zeros_like(rows)
    for r in range(rows.shape[0]):
        n = int(mask[r].sum())
        pos = torch.arange(MAX_LEN - n, MAX_LEN)
        x = rows[r : r + 1, :n] * math.sqrt(D) + model.position.weight[pos]
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)  # True: not allowed
        for block in model.blocks:
            mha = nn.MultiheadAttention(D, block.attn.heads, batch_first=True)
            mha.in_proj_weight.data.copy_(block.attn.qkv.weight)
            mha.in_proj_bias.data.copy_(block.attn.qkv.bias)
            mha.out_proj.weight.data.copy_(block.attn.out.weight)
            mha.out_proj.bias.data.copy_(block.attn.out.bias)
            h = block.attn_norm(x)
            x = x + mha.eval()(h, h, h, attn_mask=causal, need_weights=False)[0]
            x = x + block.ffn(block.ffn_norm(x))
        out[r, :n] = model.norm(x)[0]
    return out


def test_sasrec_equals_the_multihead_attention_reference():
    model = build("sasrec")
    rows, mask = batch([5, 1, 7, 3], 7)
    torch.testing.assert_close(model(rows, mask), sasrec_reference(model, rows, mask))


def hstu_reference(model: HSTU, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """HSTU in eval mode from the paper's equations, one query position at a time."""
    out = torch.zeros_like(rows)
    for r in range(rows.shape[0]):
        n = int(mask[r].sum())
        x = rows[r, :n] * math.sqrt(D) + model.position.weight[:n]  # from_start
        for block in model.blocks:
            h, dq, dv = block.heads, block.dqk, block.dv
            proj = nn.functional.silu(nn.functional.layer_norm(x, (D,), eps=1e-6) @ block.uvqk)
            u, v = proj[:, : h * dv], proj[:, h * dv : 2 * h * dv]
            q, k = proj[:, 2 * h * dv : 2 * h * dv + h * dq], proj[:, 2 * h * dv + h * dq :]
            new = torch.zeros_like(x)
            for i in range(n):
                heads = []
                for head in range(h):
                    qi = q[i, head * dq : (head + 1) * dq]
                    av = torch.zeros(dv)
                    for j in range(i + 1):
                        kj = k[j, head * dq : (head + 1) * dq]
                        a = nn.functional.silu(qi @ kj + block.rab[i - j]) / MAX_LEN
                        av = av + a * v[j, head * dv : (head + 1) * dv]
                    heads.append(av)
                av = nn.functional.layer_norm(torch.cat(heads), (h * dv,), eps=1e-6)
                new[i] = x[i] + block.out(u[i] * av)
            x = new
        out[r, :n] = nn.functional.normalize(x, dim=-1, eps=1e-6)
    return out


def test_hstu_equals_the_papers_equations():
    model = build("hstu")
    rows, mask = batch([5, 1, 4], 5)
    torch.testing.assert_close(model(rows, mask), hstu_reference(model, rows, mask))
