"""Reading a W&B offline run's ``run-*.wandb`` file back: its records (a LevelDB-style log of protobuf Records).

W&B's own Python reader left the package when its core moved to Go, so the tests read the file's published
layout: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte
header (crc32 4 bytes, length 2 bytes little-endian, type 1 byte: 1 full, 2 first, 3 middle, 4 last).
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending, found = _HEADER, b"", []
    while position + _HEADER <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        if left_in_block < _HEADER:  # the block's tail is padding
            position += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + _HEADER])
        chunk = data[position + _HEADER : position + _HEADER + length]
        position += _HEADER + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


def finished_records(path: Path, timeout: float = 30.0) -> list[Any]:
    """The records once W&B's core has written the run's ``exit`` record: ``run.finish()`` returns before its
    helper process has flushed the file (the process's exit waits for it; a test in the same process must)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = records(path) if path.stat().st_size else []
        except Exception:  # a chunk half written: read again
            found = []
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def history_and_config(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows ``run.log`` wrote, and the run's config, from the run directory's ``run-*.wandb``."""
    (path,) = run_dir.glob("run-*.wandb")
    rows: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    for record in finished_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return rows, config
