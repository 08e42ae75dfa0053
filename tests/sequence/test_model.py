"""NextItemModel (model.arch=sasrec | hstu): its one lookup per call, the grouped encoder
(rows of similar lengths, cut to their longest) equal to the whole batch's, the training
outputs' layout, and that query and candidates score as the training forward does."""

from __future__ import annotations

import pytest
import torch

from hybridrec.model.hstu import HSTU
from hybridrec.model.sasrec import SASRec
from hybridrec.model.sequential import NextItemModel, encode_grouped, with_negative_rows
from hybridrec.scoring import attach_scoring
from hybridrec.types import KeyedIds, Pooling, TableConfig

L, ITEMS, D = 6, 30, 8


def _features(negatives: int = 1) -> list[TableConfig]:
    out = [TableConfig("seq", ITEMS, D, L + 1, Pooling.NONE, storage="item")]
    if negatives:
        out.append(TableConfig("neg", ITEMS, D, L * negatives, Pooling.NONE, storage="item"))
    return out


@pytest.mark.parametrize("encoder", [SASRec, HSTU])
def test_grouped_rows_give_the_whole_batchs_states(encoder):
    torch.manual_seed(0)
    model = encoder(D, L, blocks=2, heads=2, dropout=0.0).eval()
    mask = torch.arange(L).expand(9, L) < torch.tensor(
        [[0], [1], [2], [6], [3], [5], [1], [4], [6]]
    )
    rows = torch.randn(9, L, D) * mask.unsqueeze(-1)
    with torch.no_grad():
        whole = model(rows, mask)
        for groups in (1, 2, 4, 9):
            torch.testing.assert_close(encode_grouped(model, rows, mask, groups), whole)


def test_negatives_ride_the_lookup_as_extra_rows():
    seq = torch.tensor([[1, 2, -1], [3, -1, -1]])
    out = with_negative_rows(seq, torch.tensor([7, 8, 9, 10]))
    assert out.tolist() == [[1, 2, -1], [3, -1, -1], [7, 8, 9], [10, -1, -1]]


def _model(negatives: int) -> NextItemModel:
    torch.manual_seed(0)
    model = NextItemModel(_features(negatives), "sasrec", dropout=0.0)
    attach_scoring(model)
    return model


def test_the_training_outputs_line_up_positions_targets_and_negatives():
    model = _model(negatives=2)
    seq = torch.tensor([[4, 5, 6, -1, -1, -1, -1], [9, 8, 7, 6, 5, 4, 3]])
    neg = torch.arange(2 * L * 2).view(2, L * 2) % ITEMS
    ids = KeyedIds(torch.cat([seq, neg], 1), ["seq", "neg"], [L + 1, L * 2])
    out = model(torch.zeros(2, 0), ids)
    assert out.hidden.shape == (2, L, D) and out.negatives.shape == (2, L, 2, D)
    assert torch.equal(out.target_ids, seq[:, 1:])
    assert out.mask.tolist()[0] == [True, True, False, False, False, False]
    rows = model.candidates(torch.arange(ITEMS))
    torch.testing.assert_close(out.positives[1, 0], rows[8])  # position 0 predicts event 1
    torch.testing.assert_close(out.negatives[0, 1, 1], rows[int(neg[0, 3])])


def test_query_is_the_state_after_the_last_input_event():
    model = _model(negatives=0)
    seq = torch.tensor([[4, 5, 6, -1, -1, -1, -1], [9, 8, 7, 6, 5, 4, -1]])
    ids = KeyedIds(seq, ["seq"], [L + 1])
    out = model(torch.zeros(2, 0), ids)
    states = model.query(torch.zeros(2, 0), ids)
    torch.testing.assert_close(states[0], out.hidden[0, 2])
    torch.testing.assert_close(states[1], out.hidden[1, 5])
    with pytest.raises(ValueError, match="empty history"):
        model.query(torch.zeros(1, 0), KeyedIds(torch.full((1, L + 1), -1), ["seq"], [L + 1]))


def test_a_model_without_a_sequence_feature_is_refused():
    with pytest.raises(ValueError, match="a sequence feature `seq`"):
        NextItemModel([TableConfig("seq", ITEMS, D, L + 1)], "sasrec")
    with pytest.raises(ValueError, match="sasrec's arguments"):
        NextItemModel(_features(), "sasrec", depth=3)
