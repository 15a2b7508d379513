"""The notebooks of colabs/: committed without outputs, installing only on Colab, and each executed top to
bottom by a test (a notebook added without one fails here). The sampling and GRPO notebooks run here on the
tiny random model with SmolLM2's tokenizer; the TRACE-stages and evaluation notebooks run in
tests/test_trace_pipeline.py on the tiny pipeline's workdir, which they read back instead of running again."""

import json
import pathlib
import re

import nbformat
from notebooks import COLABS, printed, run_notebook

TESTS = pathlib.Path(__file__).parent


def test_every_notebook_is_executed_by_a_test():
    notebooks = sorted(path.name for path in COLABS.glob("*.ipynb"))
    assert len(notebooks) >= 4, notebooks
    sources = "".join(path.read_text() for path in TESTS.glob("test_*.py"))
    missing = [name for name in notebooks if not re.search(rf'run_notebook\(\s*"{re.escape(name)}"', sources)]
    assert not missing, f"no test runs {missing}: add one (tests/notebooks.py: run_notebook)"


def test_notebooks_are_committed_without_outputs_and_install_only_on_colab():
    for path in sorted(COLABS.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        code = [cell for cell in notebook.cells if cell.cell_type == "code"]
        assert all(not cell.outputs and cell.execution_count is None for cell in code), f"{path.name} has outputs"
        assert '"google.colab" in sys.modules' in code[0].source and "pip install" in code[0].source, path.name


def test_the_sampling_notebook_runs_adapters_side_by_side_and_round_trips_one(tiny_chat_model, job_env, tmp_path):
    notebook = run_notebook(
        "01_sample_with_adapters.ipynb",
        {"MODEL": str(tiny_chat_model), "MAX_NEW_TOKENS": 8, "WORKDIR": str(tmp_path)},
        job_env,
    )
    assert "the base row and the reloaded adapter sample as in the shared batch" in printed(notebook)
    assert (tmp_path / "adapter_1" / "adapter_model.safetensors").is_file()


def test_the_grpo_notebook_trains_and_plots_the_reward(tiny_chat_model, job_env, tmp_path):
    overrides = {"model": str(tiny_chat_model), "lora.first_layer": 0, "train.steps": 1, "eval.num_tasks": 0}
    notebook = run_notebook(
        "02_grpo_train_adapter.ipynb",
        {"CONFIG": "grpo_tiny", "WORKDIR": str(tmp_path), "OVERRIDES": overrides},
        job_env,
    )
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in steps if "rollout/reward" in row] == [1]
    assert (tmp_path / "adapter" / "adapter_config.json").is_file() and "|B| per target" in printed(notebook)
    assert any(output.get("data", {}).get("image/png") for cell in notebook.cells for output in cell.get("outputs", ()))
