"""Small file helpers shared by the stages."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any


def write_json_atomic(path: pathlib.Path, value: Any) -> None:
    """Writes `value` through a temp file in the same folder, so a reader (or a resumed run after a
    kill) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, ensure_ascii=False, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
