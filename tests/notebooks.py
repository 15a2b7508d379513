"""Runs a notebook of colabs/ top to bottom as a user does, in a fresh Jupyter kernel (nbclient), on small
settings: the test's values go in a cell right after the one tagged `parameters` (papermill's convention), so
the notebook's own settings stay those a Colab user starts from. A cell that raises fails the test."""

import pathlib

import nbformat
from nbclient import NotebookClient

REPO = pathlib.Path(__file__).resolve().parents[1]
COLABS = REPO / "colabs"


def run_notebook(name: str, parameters: dict, env: dict[str, str], timeout_s: int = 900) -> nbformat.NotebookNode:
    """Executes colabs/`name` with `parameters` (name -> value, written as `name = repr(value)`) in a kernel
    whose environment is `env`; returns the executed notebook (its outputs, for checks)."""
    notebook = nbformat.read(COLABS / name, as_version=4)
    tagged = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", ())]
    assert len(tagged) == 1, f"{name}: one cell must be tagged 'parameters', found {len(tagged)}"
    settings = "\n".join(f"{key} = {value!r}" for key, value in parameters.items())
    notebook.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(settings))
    client = NotebookClient(
        notebook, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    )
    client.execute(env=env)
    return notebook


def printed(notebook: nbformat.NotebookNode) -> str:
    """Everything the executed notebook's cells printed (stdout streams)."""
    return "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", ())
        if output.get("name") == "stdout"
    )
