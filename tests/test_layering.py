"""The package's layers point down only: a module imports modules of lower layers, never of its own layer's other
units or above, and never the jobs (`launch`) or their configs (`configs`). Read from the source's imports, those
inside functions included, so an import hidden from module load time counts too."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
# Bottom to top; a unit is a top-level module of trace_jax or a subpackage.
LAYERS = (
    (
        "files",
        "isolation",
        "runtime",
        "settings",
        "tool_calls",
        "report",
    ),  # plain Python: files, untrusted code isolated, typed settings, wire format, tables
    ("workdirs",),  # a job's workdir: its lock and the marker of its result-deciding settings (on `files`)
    ("sharding", "models"),  # the model core: configs, decoder, per-row adapters, tokenizer, loading
    ("distributed", "lora"),  # processes over the mesh; making, merging and saving adapters
    ("metrics", "sampling", "envs", "tasks", "llm"),  # the sampler; environments and tasks; the LLM client
    ("agent",),  # the rollout engine: an agent in an environment
    ("evaluation",),  # playing and scoring episodes
    ("rl",),  # the learners and training jobs
    ("trace",),  # TRACE's stages
    ("baselines", "serve"),  # the comparison; the server
)
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
OUTSIDE = ("launch", "configs")  # the jobs and their configs sit above the package


def _unit(module: str) -> str:
    """'trace_jax.models.decoder' -> 'models'."""
    return module.split(".")[1]


def imported_modules(source: str, importer: str) -> list[str]:
    """Every absolute module `source` imports ("from trace_jax import x" as trace_jax.x), relative imports resolved
    against `importer` (a dotted module name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*importer.split(".")[: -node.level], *([base] if base else [])])
            found += [f"{base}.{alias.name}" for alias in node.names] if base == "trace_jax" else [base]
    return found


def upward_imports(source: str, importer: str) -> list[str]:
    """The imports of module `importer` (in trace_jax) that break the layering: of a job or config, or of a unit not
    in a lower layer than the importer's (another unit of its own layer included)."""
    own = _unit(importer)
    bad = []
    for module in imported_modules(source, importer):
        top = module.split(".")[0]
        if top in OUTSIDE:
            bad.append(module)
        elif top == "trace_jax" and module != "trace_jax" and _unit(module) != own:
            if RANK.get(_unit(module), len(LAYERS)) >= RANK[own]:
                bad.append(module)
    return bad


def _package_modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted((REPO / "trace_jax").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def test_every_unit_of_the_package_has_a_layer():
    units = {_unit(m) for m in _package_modules() if m != "trace_jax"}
    assert units <= set(RANK), f"units without a layer in LAYERS: {sorted(units - set(RANK))}"
    assert set(RANK) <= units, f"LAYERS names units the package lacks: {sorted(set(RANK) - units)}"


def test_the_package_imports_point_down_only():
    broken = {
        module: bad
        for module, path in _package_modules().items()
        if module != "trace_jax" and (bad := upward_imports(path.read_text(encoding="utf-8"), module))
    }
    assert not broken, f"imports against the layering: {broken}"


def test_an_upward_import_is_caught_wherever_it_hides():
    def lazy(statement: str) -> str:
        return f"def build():\n    {statement}\n"

    assert upward_imports("from trace_jax.agent.rollout import RolloutEngine\n", "trace_jax.models.decoder") == [
        "trace_jax.agent.rollout"
    ]
    assert upward_imports(lazy("from trace_jax import rl"), "trace_jax.models.embedded") == ["trace_jax.rl"]
    assert upward_imports(lazy("import configs.warmstart_embedded"), "trace_jax.trace.pipeline") == [
        "configs.warmstart_embedded"
    ]
    assert upward_imports("from launch import agents\n", "trace_jax.rl.trainer") == ["launch"]
    assert upward_imports("from trace_jax.tasks import tool_call_task\n", "trace_jax.envs.base") == [
        "trace_jax.tasks"
    ]  # another unit of the same layer
    assert upward_imports("from ..agent import rollout\n", "trace_jax.envs.base") == ["trace_jax.agent"]
    # What may be imported: lower layers, the unit itself, outside packages.
    fine = "import jax\nfrom trace_jax.files import read_json\nfrom trace_jax.models import decoder\nfrom . import x\n"
    assert upward_imports(fine, "trace_jax.models.tokenizer") == []
