"""Process-wide settings: the malloc setting applies only where JAX computes on the CPU (on GPU and
TPU hosts it serialises XLA's compile threads), and the memory it keeps is given back on request; compiled
programs persist per machine, and are dropped when a process nears the kernel's limit on memory maps; a log
of the programs a block builds tells a compile from a load of the persistent cache."""

import json
import os
import pathlib
import re
import subprocess
import sys

from multiprocess import failure_report

from trace_jax import runtime
from trace_jax.runtime import compilation_cache_dir, computes_on_cpu, full_precision_matmuls


def test_the_cpu_is_recognised_from_the_platforms_variable_or_the_installed_plugins():
    assert computes_on_cpu({}, ["jax", "jaxlib", "numpy"])
    assert not computes_on_cpu({}, ["jax", "jax-cuda13-plugin", "jax-cuda13-pjrt"])
    assert not computes_on_cpu({}, ["jax_rocm7_plugin"]) and not computes_on_cpu({}, ["libtpu"])
    assert computes_on_cpu({"JAX_PLATFORMS": "cpu"}, ["jax-cuda12-plugin"])  # a GPU build asked to run on the CPU
    assert not computes_on_cpu({"JAX_PLATFORMS": "cuda,cpu"}, ["jax"])


def test_fp32_matmuls_run_at_full_precision_on_accelerators_unless_the_user_says_otherwise():
    import jax

    before = jax.config.jax_default_matmul_precision
    try:
        assert not full_precision_matmuls({"JAX_PLATFORMS": "cpu"})  # XLA:CPU multiplies fp32 in full
        assert not full_precision_matmuls({"JAX_PLATFORMS": "cuda", "JAX_DEFAULT_MATMUL_PRECISION": "tensorfloat32"})
        assert jax.config.jax_default_matmul_precision == before
        assert full_precision_matmuls({"JAX_PLATFORMS": "cuda"})
        assert jax.config.jax_default_matmul_precision == "highest"
    finally:
        jax.config.update("jax_default_matmul_precision", before)


def test_compiled_programs_persist_in_a_folder_named_after_the_machine(tmp_path, monkeypatch):
    """Jobs keep compiled programs in the project's cache, one folder per kind of CPU (XLA:CPU compiles
    for the host's instruction sets), unless JAX_COMPILATION_CACHE_DIR names one."""
    assert compilation_cache_dir({"JAX_COMPILATION_CACHE_DIR": "/somewhere"}) == pathlib.Path("/somewhere")
    monkeypatch.setenv("TRACE_JAX_CACHE", str(tmp_path))
    folder = compilation_cache_dir({})
    assert folder.parent == tmp_path / "xla" and re.fullmatch(r"[0-9a-f]{16}", folder.name)
    assert compilation_cache_dir({}) == folder
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS")}
    show = "import launch, jax; print(jax.config.jax_compilation_cache_dir)"
    out = subprocess.run(
        [sys.executable, "-c", show],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=pathlib.Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, failure_report(out)
    assert out.stdout.strip() == str(folder)


_BUILD_TWICE = """
import json, jax, jax.numpy as jnp
from trace_jax.runtime import ProgramLog, enable_compilation_cache
enable_compilation_cache()  # in $JAX_COMPILATION_CACHE_DIR
def square_sum(x):
    return jnp.sum(x * x)
logs = []
for _ in range(2):
    jax.clear_caches()  # the second call finds the program in the persistent cache only
    with ProgramLog() as log:
        jax.jit(square_sum)(jnp.arange(7.0)).block_until_ready()
    logs.append([dict(log.compiled), dict(log.loaded), log.built])
print(json.dumps(logs))
"""


def test_the_program_log_tells_a_compile_from_a_load_of_the_persistent_cache(tmp_path):
    """Also: the jobs' persistent cache keeps a program that compiles in milliseconds (a run's small programs of
    new shapes would otherwise be compiled again by every run)."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _BUILD_TWICE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, failure_report(out)
    (compiled, loaded, built), (compiled_again, loaded_again, built_again) = json.loads(out.stdout)
    assert compiled.get("jit(square_sum)") == 1 and not loaded and built == sum(compiled.values())
    assert loaded_again.get("jit(square_sum)") == 1 and "jit(square_sum)" not in compiled_again
    assert built_again == built  # the same programs, built by loading


def test_memory_the_retained_heap_keeps_is_given_back_on_request():
    """Under `retain_freed_memory` a freed block stays resident; `release_freed_memory` hands it back to
    the OS (training jobs call it twice a step, so a long run's heap does not grow without bound)."""
    measure = """
import json, numpy as np
from trace_jax.runtime import peak_memory_gb, release_freed_memory, resident_memory_gb, retain_freed_memory
assert retain_freed_memory()
start = resident_memory_gb()
block = np.ones(400_000_000 // 8)  # 400 MB, from the heap (no mmap per block)
del block
print(json.dumps({"start": start, "freed": resident_memory_gb(), "released": release_freed_memory(),
                  "peak": peak_memory_gb()}))
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", measure],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=pathlib.Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, failure_report(out)
    gb = json.loads(out.stdout)
    print(f"\n[runtime] resident GB: {gb}")
    assert gb["freed"] >= gb["start"] + 0.35  # kept after the free
    assert gb["released"] <= gb["start"] + 0.05 and gb["peak"] >= gb["start"] + 0.35


def test_the_upkeep_of_a_long_loop_runs_first_then_at_most_once_per_interval(monkeypatch):
    released, bounded, now = [], [], [100.0]
    monkeypatch.setattr(runtime, "release_freed_memory", lambda: released.append(now[0]))
    monkeypatch.setattr(runtime, "bound_memory_maps", lambda: bounded.append(now[0]))
    upkeep = runtime.Upkeep(30.0, clock=lambda: now[0])
    calls = []
    for now[0] in (100.0, 110.0, 129.9, 130.0, 140.0, 159.0, 161.0):
        calls.append(upkeep())
    assert calls == [True, False, False, True, False, False, True]
    assert released == bounded == [100.0, 130.0, 161.0]


def test_a_process_near_the_kernels_limit_on_memory_maps_drops_its_compiled_programs():
    """XLA:CPU maps each compiled kernel apart and a process keeps every program it ran; past a share of the
    kernel's limit `bound_memory_maps` drops them (their maps go) and they compile or load again when run."""
    script = """
import json
import jax, jax.numpy as jnp
from trace_jax import runtime
fns = [jax.jit(lambda x, i=i: jnp.tanh(jnp.sin(x) * i + jnp.cos(x * i)).cumsum()) for i in range(40)]
first = [float(f(jnp.arange(64.0 + i)).sum()) for i, f in enumerate(fns)]
held, limit = runtime.memory_maps()
kept = runtime.bound_memory_maps(share=1.0)  # far from the limit: nothing happens
cached = sum(f._cache_size() for f in fns)
dropped = runtime.bound_memory_maps(share=(held - 1) / limit)
after, _ = runtime.memory_maps()
left = sum(f._cache_size() for f in fns)
repeat = runtime.bound_memory_maps(share=(held - 1) / limit)  # measured from what the drop left
again = [float(f(jnp.arange(64.0 + i)).sum()) for i, f in enumerate(fns)]
print(json.dumps(dict(held=held, after=after, kept=kept, cached=cached, dropped=dropped, repeat=repeat,
                      left=left, same=again == first)))
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=pathlib.Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, failure_report(out)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["kept"] and result["cached"] == 40
    assert result["dropped"] and result["left"] == 0 and not result["repeat"]
    assert result["after"] < result["held"] - 40  # each program held maps of its own
    assert result["same"]
