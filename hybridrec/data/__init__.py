"""Data: sources, loaders, preprocessing (Criteo, your own tables), datasets. `synthetic` (the
default) needs no files.

Names are imported on first use (PEP 562), so `hybridrec-preprocess` and its worker processes
load only numpy and pyarrow, not torch.

    build_source, build_loader       config -> source / per-rank loader   (data.build)
    SyntheticCriteo                  the endless synthetic stream          (data.synthetic)
    preprocess, PreprocessOptions    raw Criteo TSV -> binary dataset      (data.preprocess)
    load_spec, DatasetSpec           a table's dataset spec (YAML)         (data.spec)
    preprocess_table                 Parquet/CSV + spec -> binary dataset  (data.tabular)
    open_dataset, Dataset            memmapped arrays + manifest           (data.dataset)
    Manifest                         the dataset's JSON manifest           (data.manifest)
    BinarySource                     a dataset as a batch source           (data.source)
    MemmapReader, DaliReader         rows -> Batch                         (data.readers)
    SliceLoader, BroadcastLoader     per-rank / rank-0-broadcast loaders
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_source": "hybridrec.data.build",
    "build_loader": "hybridrec.data.build",
    "BatchSource": "hybridrec.data.loader",
    "SliceLoader": "hybridrec.data.loader",
    "SyntheticCriteo": "hybridrec.data.synthetic",
    "preprocess": "hybridrec.data.preprocess",
    "PreprocessOptions": "hybridrec.data.preprocess",
    "load_spec": "hybridrec.data.spec",
    "DatasetSpec": "hybridrec.data.spec",
    "preprocess_table": "hybridrec.data.tabular",
    "open_dataset": "hybridrec.data.dataset",
    "Dataset": "hybridrec.data.dataset",
    "CorruptBlockError": "hybridrec.data.dataset",
    "MalformedRowError": "hybridrec.data.criteo",
    "Manifest": "hybridrec.data.manifest",
    "BinarySource": "hybridrec.data.source",
    "MemmapReader": "hybridrec.data.readers",
    "DaliReader": "hybridrec.data.readers",
    "BroadcastLoader": "hybridrec.data.broadcast",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridrec.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
