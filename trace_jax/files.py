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
    _write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def _write_text_atomic(path: pathlib.Path, text: str) -> None:
    """Writes `text` through a temp file in the same folder, renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
