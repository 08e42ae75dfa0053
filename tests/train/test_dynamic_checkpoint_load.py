"""Dynamic tables' checkpoints checked on load (issue 41, silently wrong cases 1-4): a resume may
not change what the saved map's layout depends on (the table's rows, `buckets`, `unknown`, the
table being dynamic at all), and a saved map is checked row by row before it is copied (ids in
their rows' buckets, once each, in range, none in an unknown row, int64 1-D arrays of one value
per row, finite rows and state). Each corrupt checkpoint is made as the audit made it: the
saved shard file edited and the manifest's size and sha256 recomputed, so the checks are what
refuses it, not the checksum. Model and data: tests/distributed/dynamic_model.py (a dynamic
user table with unknown="row" in 8 buckets of 8 rows, a dynamic item table with "zeros" in 4 of
12, a fixed age table), one process, the trainer's own save_checkpoint / load_checkpoint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridrec import Dynamic
from hybridrec.distributed import DistEnv
from hybridrec.sparse.api import embedding_modules
from hybridrec.train.checkpoint import CheckpointError, CorruptCheckpointError
from hybridrec.train.checkpoint.export import export_checkpoint, init_from_export
from hybridrec.train.checkpoint.format import TrainState, model_signature, write_file
from hybridrec.train.checkpoint.load import load_checkpoint
from hybridrec.train.checkpoint.save import save_checkpoint
from tests.distributed import dynamic_model
from tests.distributed.dynamic_model import build, run_steps
from tests.libmodel import unwrap

USERS = Dynamic(admit="count", min_count=2, evict="lfu", halflife=2, unknown="row", buckets=8)
ITEMS = Dynamic(admit="always", evict="lru", buckets=4)
SAVED_AT = 3


def _model(monkeypatch, users: Dynamic | None = USERS, items: Dynamic | None = ITEMS):
    """The test model with these policies (None: a fixed table), and its dense optimizer."""
    monkeypatch.setitem(dynamic_model.POLICIES, "load", (users, items))
    return build(None, "none", None, "adagrad", "load")


def _tables(model) -> list:  # noqa: ANN001
    return [t for m in embedding_modules(unwrap(model)) for t in m.tables]


def _signature(model) -> dict:  # noqa: ANN001
    return model_signature(_tables(model), unwrap(model), "adagrad", "sgd")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint after SAVED_AT steps (the maps full, candidates waiting)."""
    with pytest.MonkeyPatch.context() as mp:
        model, opt = _model(mp)
        run_steps(model, opt, None, range(SAVED_AT))
        root = tmp_path_factory.mktemp("dyn_ckpt")
        env = DistEnv()
        save_checkpoint(
            root, TrainState(SAVED_AT, SAVED_AT, {}), unwrap(model), opt, _signature(model),
            None, env,
        )  # fmt: skip
    return root / f"step_{SAVED_AT}"


def _load(path: Path, model, opt) -> None:  # noqa: ANN001
    load_checkpoint(path, unwrap(model), opt, _signature(model))


def _edited(saved: Path, tmp_path: Path, edit: Callable[[dict], None]) -> Path:
    """A copy of checkpoint `saved` whose shard file went through `edit` (the users table's
    saved shard, in place), its manifest's size and sha256 recomputed."""
    out = tmp_path / saved.name
    out.mkdir()
    for f in saved.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((out / "manifest.json").read_text())
    name = "shards_rank0.pt"
    shards = torch.load(out / name, weights_only=True)
    (user,) = [s for s in shards["shards"] if s["table"] == "users.user"]
    edit(user)
    manifest["files"][name] = write_file(shards, out / name)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_an_unchanged_resume_loads_the_maps(saved, monkeypatch):
    model, opt = _model(monkeypatch)
    _load(saved, model, opt)
    run_steps(model, opt, None, range(SAVED_AT, SAVED_AT + 1))


# -- silently wrong 1, 2: a resume that changes the map's layout ---------------------------------
@pytest.mark.parametrize(
    "users, rows, message",
    [
        (
            Dynamic(**{**vars(USERS), "buckets": 4}),
            64,
            "Dynamic.buckets of table 'users.user' is 4, but table 'users.user' was trained with "
            "8 (its ids sit in the rows of their buckets of 8); a resume cannot change it: set it "
            "back to 8 to resume, or train the table anew (load no checkpoint)",
        ),
        (
            Dynamic(**{**vars(USERS), "unknown": "zeros"}),
            64,
            "Dynamic.unknown of table 'users.user' is 'zeros', but table 'users.user' was trained "
            "with 'row' (each bucket's last row is its trained unknown row, no id's)",
        ),
        (
            USERS,
            128,
            "the rows of dynamic table 'users.user' (Table(rows=...)) is 128, but table "
            "'users.user' was trained with 64 (its ids sit in buckets of 8 rows)",
        ),
        (
            None,
            64,
            "table 'users.user' was trained dynamic and is fixed in the model "
            "(Table('users.user', dynamic=...))",
        ),
    ],
    ids=["buckets", "unknown", "capacity", "fixed"],
)
def test_a_resume_that_changes_the_maps_layout_is_refused(saved, monkeypatch, users, rows, message):
    monkeypatch.setitem(dynamic_model.ROWS, "users.user", rows)
    model, opt = _model(monkeypatch, users=users)
    with pytest.raises(CheckpointError) as e:
        _load(saved, model, opt)
    assert str(e.value).startswith(f"checkpoint {saved}: {message}"), e.value
    assert "\n" not in str(e.value)


def _forget_policies(path: Path) -> None:
    """The manifest as checkpoints written before policies were recorded have it."""
    manifest = json.loads((path / "manifest.json").read_text())
    for t in manifest["signature"]["tables"]:
        t.pop("dynamic", None)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_unknown_row_from_a_zeros_checkpoint_is_refused(saved, monkeypatch, tmp_path):
    """The audit's case 2 on the item table (trained with "zeros": a bucket's last row may
    hold an id); also where the checkpoint recorded no policy: its map, checked row by row."""
    items = Dynamic(**{**vars(ITEMS), "unknown": "row"})
    model, opt = _model(monkeypatch, items=items)
    with pytest.raises(CheckpointError) as e:
        _load(saved, model, opt)
    assert str(e.value) == (
        f"checkpoint {saved}: Dynamic.unknown of table 'items.item' is 'row', but table "
        "'items.item' was trained with 'zeros' (each bucket's last row holds an id, not an "
        "unknown row); a resume cannot change it: set it back to 'zeros' to resume, or train "
        "the table anew (load no checkpoint)"
    )
    old = _edited(saved, tmp_path, lambda shard: None)
    _forget_policies(old)
    with pytest.raises(CorruptCheckpointError) as e:
        _load(old, model, opt)
    assert str(e.value).startswith(
        f"checkpoint file {old / 'shards_rank0.pt'}: table items.item rows 0:48: row 11, bucket "
        "0's unknown row (unknown='row'), holds id "
    ), e.value


def test_changed_buckets_of_an_unrecorded_policy_are_caught_row_by_row(
    saved, monkeypatch, tmp_path
):
    old = _edited(saved, tmp_path, lambda shard: None)
    _forget_policies(old)
    model, opt = _model(monkeypatch, users=Dynamic(**{**vars(USERS), "buckets": 4}))
    with pytest.raises(CorruptCheckpointError, match=r"whose bucket is \d of 4, not the row's"):
        _load(old, model, opt)


@pytest.mark.parametrize(
    "users",
    [
        Dynamic(**{**vars(USERS), "evict": "lru"}),
        Dynamic(**{**vars(USERS), "evict": "ttl", "ttl_steps": 3}),
        Dynamic(**{**vars(USERS), "halflife": 7}),
        Dynamic(**{**vars(USERS), "admit": "always"}),
        Dynamic(**{**vars(USERS), "min_count": 5}),
        Dynamic(**{**vars(USERS), "admit": "probability", "probability": 0.5}),
    ],
    ids=["evict", "ttl", "halflife", "admit", "min_count", "probability"],
)
def test_policy_keys_that_only_steer_decisions_may_change(saved, monkeypatch, users):
    model, opt = _model(monkeypatch, users=users)
    _load(saved, model, opt)
    run_steps(model, opt, None, range(SAVED_AT, SAVED_AT + 2))  # the map keeps its invariants


# -- silently wrong 3, 4 and the tracebacks: a saved map that breaks the map's invariants ---------
def _set(name: str, row: int, value) -> Callable[[dict], None]:  # noqa: ANN001
    def edit(shard: dict) -> None:
        shard["state"][name][row] = value

    return edit


def _replace(name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    def edit(shard: dict) -> None:
        if name == "weight":
            shard["weight"] = make(shard["weight"])
        else:
            shard["state"][name] = make(shard["state"][name])

    return edit


def _duplicate(shard: dict) -> None:
    ids = shard["state"]["dyn_slot_id"]
    ids[1] = ids[0]


def _candidate_without_count(shard: dict) -> None:
    cand = shard["state"]["dyn_cand_id"]
    (row,) = (cand >= 0).nonzero()[0].tolist()
    shard["state"]["dyn_cand_count"][row] = 0


def _nan_weight(shard: dict) -> None:
    shard["weight"][5, 2] = float("nan")


def _nan_state(shard: dict) -> None:
    (name,) = [k for k, v in shard["state"].items() if not k.startswith("dyn_")]
    shard["state"][name][6] = float("nan")


EDITS = {
    # ids moved one bucket on: each row's id hashes to the bucket before it
    "wrong_buckets": (
        _replace("dyn_slot_id", lambda ids: torch.roll(ids, 8)),
        r"row \d+ \(dyn_slot_id\) holds id \d+, whose bucket is \d of 8, not the row's bucket \d",
    ),
    "duplicate": (_duplicate, r"id \d+ is in rows 0 and 1 of dyn_slot_id \(an id has one row\)"),
    "below_-1": (
        _set("dyn_slot_id", 3, -12345),
        r"row 3's dyn_slot_id is -12345 \(a raw id is in 0\.\.9223372036854775806, -1 for none\)",
    ),
    "2^63-1": (
        _set("dyn_slot_id", 2, (1 << 63) - 1),
        r"row 2's dyn_slot_id is 9223372036854775807",
    ),
    "nan_weight_row": (_nan_weight, r"row 5's weight is not finite"),
    "nan_state": (_nan_state, r"row 6's \w+ is not finite"),
    "float32_ids": (
        _replace("dyn_slot_id", lambda ids: ids.float()),
        r"dyn_slot_id is float32, not int64 \(a float copy has rounded its values\)",
    ),
    "shortened": (
        _replace("dyn_slot_id", lambda ids: ids[:60].clone()),
        r"dyn_slot_id has shape \[60\], not \[64\]",
    ),
    "2-D": (
        _replace("dyn_slot_id", lambda ids: ids.view(8, 8).clone()),
        r"dyn_slot_id has shape \[8, 8\], not \[64\]",
    ),
    "short_weight": (
        _replace("weight", lambda w: w[:60].clone()),
        r"its weight has shape \[60, 8\], not \[64, 8\]",
    ),
    "candidate_count": (
        _candidate_without_count,
        r"row \d+ has candidate id \d+ with dyn_cand_count 0",
    ),
    "nan_score": (_set("dyn_score", 4, float("nan")), r"row 4's dyn_score is nan"),
    "negative_last": (_set("dyn_last", 7, -2), r"row 7's dyn_last is -2 \(>= 0\)"),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_a_saved_map_that_breaks_an_invariant_is_refused_in_one_line(
    saved, monkeypatch, tmp_path, case
):
    edit, message = EDITS[case]
    path = _edited(saved, tmp_path, edit)
    model, opt = _model(monkeypatch)
    with pytest.raises(CorruptCheckpointError) as e:
        _load(path, model, opt)
    text = str(e.value)
    head = f"checkpoint file {path / 'shards_rank0.pt'}: table users.user rows 0:64: "
    assert text.startswith(head) and "\n" not in text, text
    tail = "; hybridrec never writes that (an edited file?): resume from another checkpoint"
    assert text.endswith(tail), text
    assert re.match(message, text[len(head) : -len(tail)]), text


# -- a warm start from an export carries the maps' slot ids: checked the same way ----------------
@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dyn_export") / "model.pt"
    export_checkpoint(saved, out)
    return out


def test_a_warm_start_under_other_buckets_is_refused(exported, monkeypatch, tmp_path):
    model, _ = _model(monkeypatch)
    init_from_export(exported, unwrap(model), _tables(model))  # the same policy: loads
    model, _ = _model(monkeypatch, users=Dynamic(**{**vars(USERS), "buckets": 4}))
    with pytest.raises(CheckpointError) as e:
        init_from_export(exported, unwrap(model), _tables(model))
    assert re.fullmatch(
        rf"model\.init_from='{re.escape(str(exported))}': embeddings\.users\.user: row \d+ "
        r"\(slot_id\) holds id \d+, whose bucket is \d of 4, not the row's bucket \d \(a map of "
        r"other buckets, or moved ids\); warm start from an export of a table with this policy, "
        r"or train the table anew",
        str(e.value),
    ), e.value
    state = torch.load(exported, weights_only=True)
    ids = state["embeddings.users.user.slot_id"]
    state["embeddings.users.user.slot_id"] = ids.float()  # 40-bit ids: rounded
    state["embeddings.items.item.weight"][3, 1] = float("nan")
    torch.save(state, tmp_path / "bad.pt")
    model, _ = _model(monkeypatch)
    with pytest.raises(CheckpointError, match=r"embeddings\.users\.user: slot_id is float32, not"):
        init_from_export(tmp_path / "bad.pt", unwrap(model), _tables(model))
    state["embeddings.users.user.slot_id"] = ids
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(
        CheckpointError, match=r"embeddings\.items\.item: row 3 of its weight is no"
    ):
        init_from_export(tmp_path / "bad.pt", unwrap(model), _tables(model))
