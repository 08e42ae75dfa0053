"""The runtime's byte sizes and replica-sync rule (hybridrec.sparse.costs), bytes by hand."""

from __future__ import annotations

from hybridrec.sparse.costs import id_wire_bytes, replica_sync
from hybridrec.types import TableConfig


def test_replica_sync_takes_the_cheaper_way_and_counts_its_bytes():
    # 3 rows, 12 ids per rank on 2 ranks: ring all-reduce of [3, 4 + 1] fp32, 2 (W-1)/W = 1,
    # beats gathering 3 touched rows of 4 x 4 + 8 bytes
    assert replica_sync(3, 4, 12, 2) == ("all_reduce", 3 * 5 * 4)
    # 1000 rows, 4 ids per rank: each rank sends its 4 rows (and row ids) to W - 1 others
    assert replica_sync(1000, 4, 4, 2) == ("all_gather", 4 * (4 * 4 + 8))
    assert replica_sync(1000, 4, 4, 4) == ("all_gather", 3 * 4 * (4 * 4 + 8))
    # one rank: nothing to send, and gathering needs no dense buffer
    assert replica_sync(10, 4, 100, 1) == ("all_gather", 0)


def test_ids_cross_as_int32_while_every_table_fits():
    small, huge = TableConfig("s", 2**31 - 1, 8), TableConfig("h", 2**31, 8)
    assert id_wire_bytes([]) == 4 and id_wire_bytes([small]) == 4
    assert id_wire_bytes([small, huge]) == 8
