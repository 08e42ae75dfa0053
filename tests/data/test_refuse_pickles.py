"""Dataset files are read as data only: a planted numpy object array (whose unpickling would
run code) in an id counts file is refused, naming the file, and never unpickled."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from hybridrec.data import open_dataset
from hybridrec.data.source import BinarySource


class Payload:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_object_array_in_id_counts_is_refused(sample_dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(sample_dataset, data)
    source = BinarySource(open_dataset(data))
    assert source.id_counts(0) is not None  # the intact file loads
    marker = tmp_path / "ran"
    counts = data / source.dataset.manifest.tables[0].counts_file
    with np.load(counts) as z:
        ids = z["ids"]
    evil = np.empty(len(ids), dtype=object)
    evil[0] = Payload(marker)
    np.savez(counts, ids=ids, counts=evil)
    with np.load(counts, allow_pickle=True) as z:  # the check below can fail: this runs it
        z["counts"]
    assert marker.exists()
    marker.unlink()
    with pytest.raises(ValueError, match=r"cat_0.npz: refused: .*object array") as e:
        source.id_counts(0)
    assert "\n" not in str(e.value)
    assert not marker.exists()
