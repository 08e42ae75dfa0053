"""Reading per-user sequences (the `user item` format and an interaction table) and the
leave-one-out split (hybridrec.data.sequences), on small written fixtures and the real
Amazon Games file."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrec.data.sequences import (
    PAD,
    LeaveOneOut,
    last_events,
    read_interaction_table,
    read_user_item,
    sequences_from_table,
)

# users 7 (5 events), 2 (3 events), 9 (2 events: train only), 4 (1 event); 1-based items
LINES = """7 3
7 1
7 4
7 1
7 5
2 9
2 2
2 6
9 8
9 3
4 2
"""


def write(tmp_path, text: str, name: str = "seq.txt"):  # noqa: ANN201
    path = tmp_path / name
    path.write_text(text)
    return path


def test_user_item_file_gives_sequences_in_file_order_with_zero_based_rows(tmp_path):
    seqs = read_user_item(write(tmp_path, LINES))
    assert seqs.users.tolist() == [2, 4, 7, 9]  # users ascending
    assert [seqs.of(u).tolist() for u in range(4)] == [[8, 1, 5], [1], [2, 0, 3, 0, 4], [7, 2]]
    assert seqs.num_items == 9 and seqs.lengths().tolist() == [3, 1, 5, 2]
    assert read_user_item(write(tmp_path, LINES), num_items=12).num_items == 12


@pytest.mark.parametrize(
    "text,line,why",
    [
        ("1 2\n1 x\n", 2, "must be integers"),
        ("1 2\n1 2 3\n", 2, "3 fields"),
        ("1 2\n\n", 2, "empty line"),
        ("1 2\n0 3\n", 2, "start at 1"),
        ("1 2\n1 0\n", 2, "start at 1"),
        ("1 2\n2 3\n1 4\n", 3, "user 1 appears again"),
    ],
)
def test_bad_user_item_lines_name_the_file_and_line(tmp_path, text, line, why):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=f"seq.txt:{line}: .*{why}") as err:
        read_user_item(path)
    assert "\n" not in str(err.value)


def test_user_item_item_past_the_declared_rows_names_the_line(tmp_path):
    with pytest.raises(ValueError, match=r"seq.txt:3: item 7 is past the item table's 6 rows"):
        read_user_item(write(tmp_path, "1 2\n1 3\n1 7\n"), num_items=6)


def test_empty_user_item_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no events"):
        read_user_item(write(tmp_path, ""))


def test_interaction_table_groups_by_user_orders_by_time_then_item():
    users = np.array([5, 3, 5, 5, 3, 5])
    items = np.array([4, 1, 2, 0, 3, 1])
    times = np.array([20, 7, 10, 20, 5, 30])  # user 5: items 0 and 4 at the same time
    seqs = sequences_from_table(users, items, times)
    assert seqs.users.tolist() == [3, 5]
    assert seqs.of(0).tolist() == [3, 1]
    assert seqs.of(1).tolist() == [2, 0, 4, 1]  # the tie at t=20: item 0 before item 4
    assert seqs.num_items == 5


@pytest.mark.parametrize(
    "items,times,num_items,match",
    [
        ([0, -1], [1, 2], None, "row 1 has item row -1"),
        ([0, 6], [1, 2], 6, r"row 1 has item row 6, outside the item table's \[0, 6\)"),
        ([0, 1], [1.0, np.nan], None, "row 1 has a NaN time"),
        ([0.0, 1.0], [1, 2], None, "the item column holds float64, not integers"),
    ],
)
def test_bad_interaction_tables_name_the_row(items, times, num_items, match):
    with pytest.raises(ValueError, match=match):
        sequences_from_table(np.array([1, 1]), np.array(items), np.array(times), num_items)


def test_interaction_table_files_csv_and_parquet(tmp_path):
    csv = write(tmp_path, "uid,iid,ts\n1,3,5\n1,2,1\n2,1,9\n", "events.csv")
    seqs = read_interaction_table(csv, user="uid", item="iid", time="ts", item_base=1)
    assert [seqs.of(u).tolist() for u in range(2)] == [[1, 2], [0]]
    table = pa.table({"user": [1, 1, 2], "item": [2, 1, 0], "timestamp": [5.0, 1.0, 9.0]})
    pq.write_table(table, tmp_path / "events.parquet")
    seqs = read_interaction_table(tmp_path / "events.parquet")
    assert [seqs.of(u).tolist() for u in range(2)] == [[1, 2], [0]]
    with pytest.raises(ValueError, match=r"events.csv: no column 'timestamp'; its columns are"):
        read_interaction_table(csv, user="uid", item="iid")


def test_last_events_keeps_the_most_recent_left_aligned():
    items = np.arange(10)
    out = last_events(np.array([0, 3, 9]), np.array([3, 9, 9]), items, 4)
    assert out.tolist() == [[0, 1, 2, PAD], [5, 6, 7, 8], [PAD] * 4]


def test_leave_one_out_split(tmp_path):
    split = LeaveOneOut(read_user_item(write(tmp_path, LINES)))
    # users (ascending): 2 [8, 1, 5], 4 [1], 7 [2, 0, 3, 0, 4], 9 [7, 2]
    assert split.evaluated.tolist() == [0, 2]  # users with >= 3 events
    windows = split.train_windows(2)  # train: user 2 [8] (too short), 7 [2, 0, 3], 9 [7, 2]
    assert split.train_users().tolist() == [2, 3]
    assert windows.tolist() == [[2, 0, 3], [7, 2, PAD]]
    val = split.eval_split("val", 2)
    assert val.inputs.tolist() == [[8, PAD], [0, 3]]  # val input: train, the last 2 kept
    assert val.targets.tolist() == [1, 0]
    test = split.eval_split("test", 3)
    assert test.inputs.tolist() == [[8, 1, PAD], [0, 3, 0]]
    assert test.targets.tolist() == [5, 4]
    # the history a full ranking excludes: every input event, not only the kept max_len
    starts = split.seqs.offsets[test.users]
    assert [split.seqs.items[s:e].tolist() for s, e in zip(starts, test.history_ends)] == [
        [8, 1],
        [2, 0, 3, 0],
    ]
    with pytest.raises(ValueError, match="split 'train' is not one of"):
        split.eval_split("train", 2)


def test_amazon_games_counts(amazon_games):
    """The counts its README states: 287,107 actions, 31,013 users, 23,715 items."""
    seqs = read_user_item(amazon_games)
    assert len(seqs.items) == 287_107
    assert len(seqs) == 31_013
    assert seqs.num_items == 23_715 and len(np.unique(seqs.items)) == 23_715
    split = LeaveOneOut(seqs)
    assert len(split.evaluated) == int((seqs.lengths() >= 3).sum())
    test = split.eval_split("test", 50)
    assert (test.inputs[:, 0] >= 0).all()  # every evaluated user has an input event
