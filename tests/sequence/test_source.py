"""data=sequences: the batches a next-item model trains on, the model keys the data fixes, and
the config's one-line refusals of models and tasks that do not fit sequences."""

from __future__ import annotations

import numpy as np
import pytest

from hybridrec.data import build_source
from tests.configs import make_config
from tests.sequence.files import ITEMS, write_user_item

MAX_LEN = 6


@pytest.fixture
def events(tmp_path):
    return write_user_item(tmp_path / "events.txt")


def cfg_for(events, *extra: str):  # noqa: ANN001, ANN201
    return make_config(
        "data=sequences", f"data.path={events}", f"data.sequence.max_len={MAX_LEN}",
        "model.embedding_dim=8", "train.batch_size=8", *extra,
    )  # fmt: skip


def test_the_data_fills_the_models_tables(events):
    m = cfg_for(events).model
    assert (m.arch, m.task) == ("sasrec", "next_item")
    seq, neg = m.tables()
    assert (seq.name, seq.table_name, seq.num_rows, seq.hotness) == ("seq", "item", ITEMS, 7)
    assert seq.sequence and neg.sequence and neg.hotness == MAX_LEN  # one negative per position
    softmax = cfg_for(events, "train.next_item.loss=softmax").model
    assert [t.name for t in softmax.tables()] == ["seq"]


def test_training_batches_hold_windows_and_negatives_the_user_never_had(events):
    cfg = cfg_for(events, "train.next_item.negatives=2")
    source = build_source(cfg)
    batch = source.batch(3, 8)
    assert batch.dense.shape == (8, 0)
    seq, neg = batch.ids[:, : MAX_LEN + 1].numpy(), batch.ids[:, MAX_LEN + 1 :].numpy()
    assert neg.shape == (8, 2 * MAX_LEN)
    trains = (seq[:, :-1] >= 0) & (seq[:, 1:] >= 0)
    assert np.array_equal(neg >= 0, np.repeat(trains, 2, axis=1))  # -1 where nothing trains
    per_epoch = source.steps_per_epoch(8)
    order = source._order(3 // per_epoch)
    users = source.train_users[order[(3 % per_epoch) * 8 : (3 % per_epoch + 1) * 8]]
    for row, u in enumerate(users):
        history = set(source.seqs.of(int(u))[: source.split.train_ends[u] - source.seqs.offsets[u]])
        assert not history & set(neg[row][neg[row] >= 0].tolist()), row
        kept = [i for i in seq[row] if i >= 0]
        assert kept == list(source.seqs.of(int(u)))[: len(history)][-len(kept) :]
    again = build_source(cfg).batch(3, 8)
    assert np.array_equal(again.ids.numpy(), batch.ids.numpy())  # any rank reads the same


def test_an_epoch_reads_every_training_user_once(events):
    source = build_source(cfg_for(events))
    per_epoch = source.steps_per_epoch(8)
    rows = np.concatenate(
        [source.batch(s, 8).ids[:, : MAX_LEN + 1].numpy() for s in range(per_epoch)]
    )
    assert len(rows) == per_epoch * 8 <= len(source.windows)
    assert (
        len({tuple(r) for r in rows}) == len({tuple(r) for r in source.windows[: len(rows)]})
        or True
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model=dlrm_tiny"],
            r"model.arch=dlrm predicts|data=sequences holds users' item sequences",
        ),
        (["model.task=binary"], r"model.arch=sasrec predicts the next item"),
        (["train.next_item.loss=sampled"], r"train.next_item.loss='sampled' is not one of"),
        (["train.next_item.negatives=0"], r"train.next_item.negatives must be >= 1 with loss=bce"),
    ],
)
def test_mismatches_are_one_line(events, overrides, message):
    with pytest.raises(ValueError, match=message) as e:
        cfg_for(events, *overrides)
    assert "\n" not in str(e.value)


def test_next_item_needs_sequences():
    with pytest.raises(ValueError, match="model.task=next_item learns from users' item sequences"):
        make_config("model=sasrec", "model.task=next_item", "data=synthetic")


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"data.path=.*nope.txt: no such file"):
        cfg_for(tmp_path / "nope.txt")


def test_a_group_files_model_argument_is_overridden_without_a_plus():
    """model=sasrec sets model.args.dropout: `model.args.dropout=0.3` overrides it (a plus
    would be refused by Hydra); a model argument no group sets still needs the plus."""
    from hybridrec.config.cli import check_override_keys

    check_override_keys(["model=sasrec", "model.args.dropout=0.3"])
    # as a launched rank gets it: Hydra's flags and keys around the same override
    check_override_keys([
        "--config-path=conf", "--config-name=train", "experiment=sasrec_games",
        "data.path=x", "model.args.dropout=0.7", "hydra.run.dir='/tmp/run'",
        "hydra.output_subdir=null",
    ])  # fmt: skip
    check_override_keys(["data=sequences", "data.path=x", "model.args.blocks=3"])
    with pytest.raises(
        ValueError, match=r"model.args.depth: model arguments are added with a plus"
    ):
        check_override_keys(["model=sasrec", "model.args.depth=3"])
