"""model.label_mean: data=table gives a regression model the train split's mean label, and
two_tower's global bias starts there (matrix factorisation's global mean), so the dense
optimizer's default learning rate need not walk it from 0 to the mean rating."""

from __future__ import annotations

import numpy as np
import pytest

from hybridrec.data.dataset import open_dataset
from hybridrec.distributed import init_distributed
from hybridrec.train.trainer import Trainer
from tests.configs import make_config
from tests.retrieval.tables import small_dataset

MF = [
    "model.arch=two_tower",
    "+model.args.user_features=[user_id]",
    "+model.args.item_features=[item_id]",
    "+model.args.tower_mlp=[]",
    "device=cpu",
    "train.batch_size=16",
]


def test_two_towers_global_bias_starts_at_the_train_mean_label(tmp_path):
    data = small_dataset(tmp_path)  # a regression table: ratings 1..5
    ds = open_dataset(data)
    a, b = ds.split("train")
    mean = float(np.mean(ds.labels[a:b], dtype=np.float64))
    assert abs(mean - float(np.mean(ds.labels[:], dtype=np.float64))) > 1e-6  # train's alone
    cfg = make_config("data=table", f"data.path={data}", *MF)
    assert cfg.model.task == "regression" and cfg.model.label_mean == pytest.approx(mean)
    model = Trainer(cfg, init_distributed("cpu")).model
    assert float(model.bias) == pytest.approx(mean)
    given = make_config("data=table", f"data.path={data}", *MF, "model.label_mean=2.5")
    assert given.model.label_mean == 2.5  # the user's value is kept
    retrieval = make_config("data=table", f"data.path={data}", *MF, "model.task=retrieval")
    assert retrieval.model.label_mean is None  # no label is read: no global bias
