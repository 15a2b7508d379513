"""Small file helpers shared by the stages. Text files are UTF-8 whatever the locale, read and written alike."""

from __future__ import annotations

import filecmp
import json
import os
import pathlib
import tempfile
from collections.abc import Callable
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# The mode a file made by `open` gets (0o666 less the umask), for the temp files renamed into place, which
# `mkstemp` makes 0o600: adapters and models exported for other users to read. Read once, at import (setting the
# umask to read it is not thread-safe).
_NEW_FILE_MODE = 0o666 & ~_umask()


class UnreadableJson(ValueError):
    """A JSON file that does not parse: truncated or corrupt (the writers here never leave one half-written)."""


def read_json(path: pathlib.Path) -> Any:
    """The JSON value in `path`, a UTF-8 file as the writers here write them; UnreadableJson, naming the file and
    what to do, when it does not parse."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise UnreadableJson(
            f"{path} is not valid JSON ({error}): the file is truncated or corrupt; restore it, or delete it to "
            "have the job that wrote it write it anew"
        ) from None


def write_json_atomic(path: pathlib.Path, value: Any) -> None:
    """Writes `value` as JSON so that a reader (or a resumed run after a kill) sees the old file or the
    new one, never half of one."""
    write_text_atomic(path, json.dumps(value, ensure_ascii=False, indent=1))


def write_jsonl_atomic(path: pathlib.Path, records: list[Any]) -> None:
    """Writes `records` one JSON object a line, atomically as `write_json_atomic`."""
    write_text_atomic(path, "".join(map(_jsonl_line, records)))


def append_jsonl(path: pathlib.Path, record: Any) -> None:
    """Appends `record` as one line, as `write_jsonl_atomic` writes them (a kill may cut the last line; readers
    such as `trace_jax.agent.episodes.recorded_episodes` stop before it)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(_jsonl_line(record))


def _jsonl_line(record: Any) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"


def write_if_changed(path: pathlib.Path, data: bytes) -> None:
    """Writes `data` to `path` as `write_file_if_changed` does."""
    write_file_if_changed(path, lambda tmp: tmp.write_bytes(data))


def write_file_if_changed(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    """Has `write` write the file at the path it is given (a temp file beside `path`) and moves it to `path`,
    unless `path` already holds the same bytes (compared a block at a time: a merged model need not fit in memory
    twice). An unchanged file keeps its modification time, so `trace_jax.models.model.weights_fingerprint` finds
    the content hash it remembered for the folder instead of reading the weights again."""
    _write_through_temp(path, write, keep_unchanged=True)


def write_text_atomic(path: pathlib.Path, text: str) -> None:
    """Writes `text` (UTF-8) to `path` through a temp file renamed into place."""
    _write_through_temp(path, lambda tmp: tmp.write_bytes(text.encode()), keep_unchanged=False)


def _write_through_temp(path: pathlib.Path, write: Callable[[pathlib.Path], None], *, keep_unchanged: bool) -> None:
    """Writes through a temp file in the same folder, renamed into place: a reader (or a run resumed after a
    kill) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(pathlib.Path(tmp))
        os.chmod(tmp, _NEW_FILE_MODE)  # after `write`, which may have made the file anew
        if keep_unchanged and path.is_file() and filecmp.cmp(tmp, path, shallow=False):
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
