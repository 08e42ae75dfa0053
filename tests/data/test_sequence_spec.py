"""A list column read as a sequence (`pooling: none`): truncation keeps the most recent
events, in order; the dataset's model declares it unpooled; a single column cannot be one."""

from __future__ import annotations

import numpy as np
import pytest

from hybridrec.data.dataset import open_dataset
from hybridrec.data.spec import parse_spec
from hybridrec.data.table_model import dataset_model
from hybridrec.data.tabular import preprocess_table
from hybridrec.data.tabular.columns import pad
from tests.data.tables import spec_dict, write_parquet


def test_pad_keeps_the_first_ids_of_a_bag_and_the_last_of_a_sequence():
    ids = np.array([1, 2, 3, 4, 5, 6, 7], np.int64)
    offsets = np.array([0, 4, 4, 7])  # [1 2 3 4], [], [5 6 7]
    bag, cut = pad(ids, offsets, 3)
    seq, cut_seq = pad(ids, offsets, 3, keep_last=True)
    assert bag.tolist() == [[1, 2, 3], [-1, -1, -1], [5, 6, 7]] and cut == 1
    assert seq.tolist() == [[2, 3, 4], [-1, -1, -1], [5, 6, 7]] and cut_seq == 1


def _sequence_spec(**changes: object) -> dict:
    d = spec_dict()
    d["sparse"] = [
        {"name": "user", "column": "user", "encoding": "vocabulary", "min_count": 2},
        {"name": "history", "column": "history", "kind": "list", "pooling": "none",
         "max_len": 2, "table": "movie"},
        {"name": "movie", "column": "movie", "encoding": "vocabulary"},
    ]  # fmt: skip
    d["sparse"][1].update(changes)
    d["tables"] = [{"name": "user", "width": 8}, {"name": "movie", "width": 8}]
    return d


def test_a_sequence_column_keeps_its_most_recent_events(tmp_path):
    n = 40
    history = [None if i % 9 == 0 else [(i + k) % 13 for k in range(i % 4)] for i in range(n)]
    cols = {
        "rating": [1 + (i * 7) % 5 for i in range(n)],
        "age": [float(20 + i % 30) for i in range(n)],
        "user": [f"u{i % 5}" for i in range(n)],
        "movie": [i % 13 for i in range(n)],
        "history": history,
    }
    src = write_parquet(tmp_path / "t.parquet", cols)
    out = tmp_path / "bin"
    preprocess_table(parse_spec(_sequence_spec()), [src], out, block_rows=16, batch_rows=8)
    ds = open_dataset(out)
    cat = np.asarray(ds.categorical)
    # the shared movie vocabulary: a movie has one id in either column
    movie_id = {cols["movie"][r]: int(cat[r, 3]) for r in range(n // 2)}  # train rows
    for r in range(n // 2):
        h = history[r] or []
        kept = [movie_id.get(m, 1) for m in h[-2:]]  # the last two, oldest first
        assert cat[r, 1:3].tolist() == kept + [-1] * (2 - len(kept)), r
    model = dataset_model(ds.manifest)
    assert model["pooling"][1] == "none"


def test_a_single_column_cannot_be_a_sequence():
    d = _sequence_spec()
    d["sparse"][0]["pooling"] = "none"
    with pytest.raises(ValueError, match=r"pooling.*none \(a sequence\) needs kind: list"):
        parse_spec(d)
