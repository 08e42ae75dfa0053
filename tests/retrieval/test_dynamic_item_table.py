"""Retrieval with a dynamic item table (issue 41): logQ needs a count per item row, which raw
ids do not have (they get rows only while training); the refusal says so, and what to do,
instead of asking to re-run preprocessing although counts/<table>.npz is there."""

from __future__ import annotations

import pytest

from hybridrec.distributed import init_distributed
from hybridrec.train.trainer import Trainer
from tests.configs import make_config
from tests.retrieval.tables import ITEMS, TWO_TOWER, USERS, interactions, spec, write_dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    s = spec(USERS, ITEMS)
    s["sparse"][1] = {"name": "item_id", "column": "item_id", "encoding": "dynamic", "capacity": 64}
    return write_dataset(tmp_path_factory.mktemp("dynamic_items"), interactions(), s)


def _cfg(data, *extra: str):  # noqa: ANN202
    return make_config(
        "data=table", f"data.path={data}", "device=cpu", "train.batch_size=16", "train.steps=4",
        "eval.batch_size=7", *TWO_TOWER, *extra,
    )  # fmt: skip


def test_logq_with_a_dynamic_item_table_says_why_and_what_to_do(data, tmp_path):
    assert (data / "counts" / "item_id.npz").is_file()  # the counts are there: of raw ids
    with pytest.raises(ValueError) as e:
        Trainer(_cfg(data), init_distributed("cpu"), tmp_path)
    assert str(e.value) == (
        "train.retrieval.logq=true corrects each item row's logit by its count in the training "
        "rows, but item table 'item_id' is dynamic: its raw ids get rows only while training, "
        "and the dataset's counts/item_id.npz counts raw ids, not rows; set "
        "train.retrieval.logq=false (or give the item column a fixed encoding, vocabulary or "
        "identity, to keep logQ)"
    )
    result = Trainer(_cfg(data, "train.retrieval.logq=false"), init_distributed("cpu"), tmp_path)
    assert result.fit()["train"]["step"] == 4  # what the message says to do trains
