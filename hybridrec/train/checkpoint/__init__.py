"""Checkpoints that survive crashes and load under any sharding plan and world size.

    format.py   the on-disk layout (manifest, shard files, dense.pt), checksums, listing
    save.py     atomic saves from every rank; checking checkpoint.dir before training
    load.py     manifest checks, choosing the resume checkpoint, resharding loads (each saved
                rectangle checked before it is copied)
    dynamic.py  what a resume may change of a dynamic table's policy
    export.py   one file with the full model (hybridrec-export), and model.init_from
    convert.py  the one trusted, explicit rewrite of checkpoints holding pickled objects

Why not torch.distributed.checkpoint: its resharding works on DTensor placements, which
cannot express our uneven column and row splits (8 columns over 3 ranks: 3/3/2), and
ShardedTensor, which can, is deprecated. The format in format.py is small, explicit and
exact. The names below are the interface the trainer and the export CLI use.
"""

from hybridrec.train.checkpoint.export import export_checkpoint, init_from_export
from hybridrec.train.checkpoint.format import (
    CheckpointError,
    CorruptCheckpointError,
    TrainState,
    list_checkpoints,
    model_signature,
)
from hybridrec.train.checkpoint.load import (
    check_matches,
    checkpoint_step,
    intact_before,
    load_checkpoint,
    read_manifest,
    resolve_resume,
)
from hybridrec.train.checkpoint.save import check_writable, save_checkpoint

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "TrainState",
    "check_matches",
    "check_writable",
    "checkpoint_step",
    "export_checkpoint",
    "init_from_export",
    "intact_before",
    "list_checkpoints",
    "load_checkpoint",
    "model_signature",
    "read_manifest",
    "resolve_resume",
    "save_checkpoint",
]
