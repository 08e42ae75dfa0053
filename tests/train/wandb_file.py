"""Read a W&B offline run file (`<run dir>/wandb/offline-run-*/run-*.wandb`) in tests.

Records are parsed with wandb's own protobuf `Record` type. wandb 0.31 ships no Python reader
for the file (its DataStore moved into the Go core), so `read_records` decodes the framing, a
LevelDB-style log: a 7-byte file header (":W&B", magic 0xBEE1, version), then 32 KiB blocks of
chunks, each with a 7-byte header (CRC-32 of type byte + payload, uint16 length, uint8 type:
full/first/middle/last) and zero padding where fewer than 7 bytes remain in a block.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _LAST = 1, 2, 4


def read_records(path: Path) -> list[Any]:
    """Every `wandb_internal_pb2.Record` in a .wandb file, CRC-checked."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B run file"
    records, pos, parts = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # block trailer: zero padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0:  # zero fill after the last record
            break
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad CRC at byte {pos}"
        pos += _HEADER + length
        parts = chunk if kind in (_FULL, _FIRST) else parts + chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
    return records


def _value(item: Any) -> Any:
    if item.value_json:
        return json.loads(item.value_json)
    which = item.WhichOneof("value")
    return None if which in (None, "none") else getattr(item, which)


def history(records: list[Any]) -> list[dict[str, Any]]:
    """History rows as {key: value}; nested keys joined with '.'."""
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {".".join(i.nested_key) or i.key: _value(i) for i in r.history.item}
            rows.append(row)
    return rows


def run_record(records: list[Any]) -> Any:
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def offline_run_file(run_dir: Path) -> Path:
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline run under {run_dir}/wandb, got {files}"
    return files[0]
