"""Small file helpers shared by the stages."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any


def write_json_atomic(path: pathlib.Path, value: Any) -> None:
    """Writes `value` as JSON so that a reader (or a resumed run after a kill) sees the old file or the
    new one, never half of one."""
    _write_text_atomic(path, json.dumps(value, ensure_ascii=False, indent=1))


def write_jsonl_atomic(path: pathlib.Path, records: list[Any]) -> None:
    """Writes `records` one JSON object a line, atomically as `write_json_atomic`."""
    _write_text_atomic(path, "".join(map(_jsonl_line, records)))


def append_jsonl(path: pathlib.Path, record: Any) -> None:
    """Appends `record` as one line, as `write_jsonl_atomic` writes them (a kill may cut the last line; readers
    such as `trace_jax.evaluation.recorded_episodes` stop before it)."""
    with open(path, "a") as f:
        f.write(_jsonl_line(record))


def _jsonl_line(record: Any) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"


def write_if_changed(path: pathlib.Path, data: bytes) -> None:
    """Writes `data` atomically unless `path` already holds it: an unchanged file keeps its modification time,
    which `trace_jax.models.model.weights_fingerprint` reads (an adapter exported again by a resumed run is still
    the adapter an evaluation recorded its episodes for)."""
    if not (path.is_file() and path.read_bytes() == data):
        _write_bytes_atomic(path, data)


def _write_text_atomic(path: pathlib.Path, text: str) -> None:
    _write_bytes_atomic(path, text.encode())


def _write_bytes_atomic(path: pathlib.Path, data: bytes) -> None:
    """Writes `data` through a temp file in the same folder, renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
