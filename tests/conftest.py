"""Test-session setup: 8 fake CPU devices (for the sharding tests), offline hubs, fp32, one
compilation cache for the session's processes (a fresh folder: a test's timing never depends on
what earlier sessions left), XLA's cheapest compile except where SmolLM2 runs long, and the split
between two pytest-xdist workers (`make test` runs `-n 2`): the tests that run jobs on SmolLM2 as
subprocesses, one after another on one worker, first; then every other module as either worker is free, the
slowest first.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Most tests compile many programs and run each a few times, so XLA compiles without LLVM's optimisations
# (the packed learner's tiny-model tests ran about 20% faster). Modules marked `optimized_xla` run SmolLM2
# long enough that optimised code pays (unoptimised, it decodes one row 2.7x slower): `xla_optimization`.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="trace_jax_xla_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import pathlib  # noqa: E402

from trace_jax.runtime import enable_compilation_cache, full_precision_matmuls, retain_freed_memory  # noqa: E402

if "PYTEST_XDIST_WORKER" not in os.environ:  # beside a job, a worker gives freed memory back
    retain_freed_memory()  # as every launch entry point does (see launch/__init__.py)
enable_compilation_cache()
full_precision_matmuls()  # the parity bounds are fp32's, also where the suite runs on a GPU

import jax  # noqa: E402
import pytest  # noqa: E402
from hf_checkpoints import make_chat_checkpoint, make_checkpoint  # noqa: E402

# Modules whose tests run jobs on SmolLM2 (subprocesses of several GB each; two at once would not fit in
# 24 GB): they run on one worker, one after another and first. Jobs on the tiny chat model are light.
JOB_MODULES = ("test_grpo_env_job.py",)
# The other modules that take longest (1-7 minutes each on the faster CPU kind), handed out next, longest first,
# so that the suite does not end on one of them while the other worker is idle; the rest follow in file order.
SLOW_MODULES = (
    "test_trace_pipeline.py",
    "test_fused_session.py",
    "test_gemma3.py",
    "test_packed_learner.py",
    "test_sft_job.py",
    "test_grpo_job.py",
    "test_env_writer.py",
    "test_token_fidelity.py",
    "test_bench_scripts.py",
    "test_hints.py",
)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def _is_job_test(nodeid: str) -> bool:
    return _module(nodeid) in JOB_MODULES


def _hand_out_order(nodeid: str) -> int:
    """0 for the job modules, then the slow modules in their order, then every other module."""
    if _is_job_test(nodeid):
        return 0
    module = _module(nodeid)
    return 1 + SLOW_MODULES.index(module) if module in SLOW_MODULES else 1 + len(SLOW_MODULES)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: _hand_out_order(item.nodeid))  # stable: a module's tests stay in their order


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # hand work out in collection order: the jobs first, the slow next


def pytest_xdist_make_scheduler(config, log):
    """Work units by module, except that all job modules make one unit (xdist's `--dist loadgroup` does
    not group under pytest 9: it renames `item._nodeid`, which pytest 9 no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415 (only under xdist)

    class JobsOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "jobs" if _is_job_test(nodeid) else nodeid.split("::", 1)[0]

    return JobsOnOneWorker(config, log)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, tuple[pathlib.Path, object]]:
    """family -> (HF folder, torch model) for tiny random Llama, Qwen2, Qwen3 and Gemma 3 models."""
    root = tmp_path_factory.mktemp("tiny")
    return {fam: (root / fam, make_checkpoint(fam, root / fam)) for fam in ("llama", "qwen2", "qwen3", "gemma3")}


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> pathlib.Path:
    """A random two-layer model with SmolLM2's chat tokenizer (HF folder): for jobs whose tests check
    mechanics (stages, artifacts, resumes), which it runs in a fraction of SmolLM2's compile time."""
    from trace_jax.models.embedded import embedded_model_dir

    return make_chat_checkpoint(embedded_model_dir(), tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache), fp32."""
    from trace_jax.models.model import load_model

    return load_model("smollm2-135m-instruct")


def _optimized(node) -> bool:
    return node.get_closest_marker("optimized_xla") is not None


@pytest.fixture(scope="module", autouse=True)
def xla_optimization(request):
    """XLA's full optimisation while a module marked `optimized_xla` runs (the flag is read per compile)."""
    if not _optimized(request.node):
        yield
        return
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="module")
def job_env(request) -> dict[str, str]:
    """The environment a job subprocess runs in, as a user's: one CPU device (not the 8 fake ones
    above; a job's mesh takes every device, which multiplies its memory), the session's compilation
    cache, and XLA's full optimisation where the module is marked `optimized_xla`."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if _optimized(request.node):
        env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"
    return env
