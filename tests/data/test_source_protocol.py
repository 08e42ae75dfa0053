"""Every data source answers the whole BatchSource protocol (hybridrec.data.loader): the
trainer, the loaders and the input checks call its methods, never probe for attributes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrec.data.dataset import open_dataset
from hybridrec.data.loader import BatchSource, SliceLoader
from hybridrec.data.source import BinarySource
from hybridrec.data.synthetic import SyntheticCriteo
from hybridrec.train.dense_check import dataset_locator, dense_names
from hybridrec.types import Batch, TableConfig


class Counting(BatchSource):
    """The least a source implements: its batches and its epoch length."""

    def batch(self, step: int, batch_size: int, split: str = "train") -> Batch:
        x = torch.arange(step * batch_size, (step + 1) * batch_size)
        return Batch(x.float().view(-1, 1), x.view(-1, 1), (x % 2).float())

    def steps_per_epoch(self, batch_size: int, split: str = "train") -> int | None:
        return None


def test_a_source_must_serve_batches_and_say_its_epoch_length():
    class NoEpochs(BatchSource):
        def batch(self, step: int, batch_size: int, split: str = "train") -> Batch:
            raise AssertionError

    with pytest.raises(TypeError, match="steps_per_epoch"):
        NoEpochs()  # type: ignore[abstract]


def test_what_a_source_does_not_know_is_none_and_slices_come_from_its_batches():
    src = Counting()
    assert src.split_rows("eval") is None and src.id_counts(0) is None
    assert src.row_of(3, 8, "train", 2) is None and src.dense_names() is None
    assert src.slice_batch(2, 8, "train", 4, 6).ids.view(-1).tolist() == [20, 21]
    rank1 = SliceLoader(src, 1, 2, 8, "train")
    assert next(rank1).ids.view(-1).tolist() == [4, 5, 6, 7]
    rank1.close()
    src.close()
    assert dataset_locator(src, 8)(0, 3) is None and dense_names(src) is None


def test_synthetic_data_knows_its_id_popularity_and_nothing_of_rows():
    src = SyntheticCriteo([TableConfig("t", 50, 4)], num_dense=2)
    counts = src.id_counts(0)
    assert isinstance(counts, np.ndarray) and counts.shape == (50,) and counts.sum() > 0
    assert src.split_rows("eval") is None and src.row_of(0, 4, "train", 0) is None


def test_a_dataset_source_names_rows_features_and_split_sizes(sample_dataset):
    ds = open_dataset(sample_dataset)
    src = BinarySource(ds, shuffle=True, seed=3)
    assert src.dense_names() == [f"I{i}" for i in range(1, 14)]
    assert (src.split_rows("train"), src.split_rows("eval"), src.split_rows("test")) == (
        160,
        20,
        20,
    )
    assert src.id_counts(0) is not None
    batch = src.batch(5, 16, "train")  # a shuffled epoch: rows are not in file order
    locate = dataset_locator(src, 16, "train")
    for sample in (0, 7, 15):
        where = locate(5, sample)
        assert where is not None and where.endswith(f" of dataset {sample_dataset}")
        row = int(where.split()[1])
        assert torch.equal(batch.dense[sample], torch.from_numpy(np.array(ds.dense[row])))
    src.close()
