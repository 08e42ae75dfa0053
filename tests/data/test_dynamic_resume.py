"""Resuming a data=table run with dynamic tables under other policy keys (issue 41, silently
wrong cases 1 and 2, as a user meets them): a change of `buckets` or `unknown` is refused
before the model is built, in one line naming the config key and the spec's, and what to do;
a key that only steers decisions (evict) resumes, with a warning naming it. The dataset is
tests/data/test_dynamic_spec.py's (a count-admitted user table in 8 buckets, item and tag
tables with the defaults)."""

from __future__ import annotations

import logging

import pytest

from hybridrec.data.spec import parse_spec
from hybridrec.data.tabular import preprocess_table
from hybridrec.distributed import init_distributed
from hybridrec.train.checkpoint import CheckpointError
from hybridrec.train.trainer import Trainer
from tests.configs import make_config
from tests.data.tables import DYNAMIC_SPEC as SPEC
from tests.data.tables import dynamic_columns as _cols
from tests.data.tables import write_parquet


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the dataset, a checkpoint directory holding step_2 of a run on it)."""
    tmp = tmp_path_factory.mktemp("dynamic_resume")
    preprocess_table(parse_spec(SPEC), [write_parquet(tmp / "t.parquet", _cols())], tmp / "pq")
    ck = tmp / "ck"
    Trainer(_cfg(tmp / "pq", ck, 2), init_distributed("cpu"), tmp / "run").fit()
    return tmp / "pq", ck


def _cfg(data, ck, steps: int, *more: str):  # noqa: ANN001, ANN202
    return make_config(
        "data=table", f"data.path={data}", "train.batch_size=4", "eval.batch_size=4",
        "eval.batches=1", f"train.steps={steps}", f"checkpoint.dir={ck}", "device=cpu", *more,
    )  # fmt: skip


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "+model.dynamic.user.buckets=4",
            "model.dynamic.user.buckets (the spec's policy.buckets) is 4, but table 'user' was "
            "trained with 8 (its ids sit in the rows of their buckets of 8); a resume cannot "
            "change it: set it back to 8 to resume, or train the table anew "
            "(checkpoint.resume=never, or another checkpoint.dir)",
        ),
        (
            "+model.dynamic.user.unknown=row",
            "model.dynamic.user.unknown (the spec's policy.unknown) is 'row', but table 'user' "
            "was trained with 'zeros' (each bucket's last row holds an id, not an unknown row); "
            "a resume cannot change it: set it back to 'zeros' to resume, or train the table "
            "anew (checkpoint.resume=never, or another checkpoint.dir)",
        ),
    ],
    ids=["buckets", "unknown"],
)
def test_a_resume_that_changes_a_maps_layout_names_the_key(trained, override, message):
    data, ck = trained
    with pytest.raises(CheckpointError) as e:
        Trainer(_cfg(data, ck, 4, override), init_distributed("cpu"))
    assert str(e.value) == f"checkpoint {ck / 'step_2'}: {message}"


def test_a_resume_under_another_eviction_warns_and_trains(trained, caplog, tmp_path):
    data, ck = trained
    run = _cfg(data, tmp_path / "ck", 3, "+model.dynamic.user.evict=lfu")
    run.checkpoint.resume = str(ck / "step_2")  # its own checkpoint.dir: `trained` stays
    t = Trainer(run, init_distributed("cpu"), tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="hybridrec"):
        t.fit()
    assert t.step == 3
    assert (
        "resuming dynamic tables under other policy values (user.evict 'lru' -> 'lfu'): their "
        "maps decide by the new values from step 2 on" in caplog.text
    )
