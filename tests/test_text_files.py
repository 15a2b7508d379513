"""Text files are UTF-8 whatever the locale: the package names the encoding wherever it opens a text file, and its
JSON files round-trip non-ASCII text (a user's name, τ²'s domain names) under a locale whose encoding is ASCII; a
JSON file cut short fails naming itself."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

from trace_jax.files import UnreadableJson, read_json, write_json_atomic

REPO = pathlib.Path(__file__).resolve().parents[1]
OPENERS = {"open", "read_text", "write_text"}  # builtins.open, Path.open, Path.read_text, Path.write_text


def _opens_text_without_encoding(call: ast.Call) -> bool:
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if name not in OPENERS or any(keyword.arg == "encoding" for keyword in call.keywords):
        return False
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "os":
        return False  # os.open: a file descriptor, bytes only
    if name != "open":
        return True
    mode_at = 1 if isinstance(func, ast.Name) else 0  # open(path, mode) or path.open(mode)
    mode = next(
        (k.value for k in call.keywords if k.arg == "mode"), call.args[mode_at] if len(call.args) > mode_at else None
    )
    return not (isinstance(mode, ast.Constant) and "b" in mode.value)


def test_every_text_file_the_package_opens_names_its_encoding():
    found = []
    for folder in ("trace_jax", "launch", "configs"):
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            found += [
                f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Call) and _opens_text_without_encoding(node)
            ]
    assert not found, "text files opened in the locale's encoding:\n" + "\n".join(found)


USER = "Zoë Åström"
# The child's source is ASCII (its command line is decoded in the locale's encoding too).
ROUND_TRIP = r"""
import locale, pathlib, sys
from trace_jax.agent.episodes import recorded_episodes
from trace_jax.files import append_jsonl, read_json, write_json_atomic, write_jsonl_atomic

assert locale.getpreferredencoding(False) == "ANSI_X3.4-1968", locale.getpreferredencoding(False)
folder, record = pathlib.Path(sys.argv[1]), {"user": "Zo\u00eb \u00c5str\u00f6m", "domain": "\u03c4\u00b2-bench"}
write_json_atomic(folder / "value.json", record)
write_jsonl_atomic(folder / "episodes.jsonl", [record])
append_jsonl(folder / "episodes.jsonl", {**record, "trial": 1})
assert read_json(folder / "value.json") == record
assert recorded_episodes(folder / "episodes.jsonl") == [record, {**record, "trial": 1}]
"""


def test_json_files_round_trip_non_ascii_text_under_an_ascii_locale(tmp_path):
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}  # locale encoding: ASCII
    out = subprocess.run(
        [sys.executable, "-c", ROUND_TRIP, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "value.json").read_bytes().decode("utf-8").count(USER) == 1


def test_a_truncated_workdir_json_fails_naming_the_file_and_what_to_do(tmp_path):
    path = tmp_path / "stages.json"
    write_json_atomic(path, {"base": {"seconds": 1.0}})
    path.write_text(path.read_text(encoding="utf-8")[:-3], encoding="utf-8")  # a copy cut short
    with pytest.raises(UnreadableJson, match=rf"{re.escape(str(path))} is not valid JSON .* delete it"):
        read_json(path)
