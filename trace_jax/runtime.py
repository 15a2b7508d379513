"""Process-wide settings that make XLA:CPU fast on Linux (call `retain_freed_memory()` first thing),
a persistent compilation cache, a bound on the memory maps compiled programs hold, the project's cache
folder, the CPU's name for benchmark output, and a log of the programs XLA builds while a block runs.

XLA:CPU allocates one temporary arena per executable run (gigabytes for a learner step) and
frees it afterwards. glibc hands such blocks straight back to the OS, so every run page-faults
them afresh, and a learner step spends much of its time in the kernel. Keeping freed memory in
the process instead (one arena, no mmap for large blocks, never trimmed) removes those faults once
the heap has grown; the cost is that the process keeps its peak memory. Where JAX computes on a
GPU or TPU the setting is left off: there XLA compiles on many threads, and one arena serialises
their allocations. The measurements: docs/design.md, "Runtime settings".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib.metadata
import os
import pathlib
import platform
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping

from absl import logging

# mallopt(3) parameters from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def retain_freed_memory() -> bool:
    """Tells glibc malloc to reuse freed memory instead of returning it to the OS.

    Call it before JAX starts its threads (at the top of a program). Returns False, doing
    nothing, where the C library is not glibc (macOS, musl) or JAX will not compute on the CPU.
    """
    mallopt = _glibc_function("mallopt") if computes_on_cpu() else None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # One arena, so large blocks come from the main heap; no mmap per block; -1 (as size_t) = never trim.
    return all(
        mallopt(param, value) == 1 for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
    )


def release_freed_memory() -> float | None:
    """Hands the free pages of the retained heap back to the OS (glibc's malloc_trim) and returns the
    process's resident memory in GB afterwards (None where that cannot be done or read).

    With `retain_freed_memory` the heap only grows: a long job whose programs need arenas of many
    sizes (the embedded agent's GRPO steps: rollout programs of each bucket, then the learner's)
    fragments it until the machine's memory runs out. Called after a training step's rollouts and after its
    update, it costs a round of page faults per phase, not one per executable run."""
    malloc_trim = _glibc_function("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)
    return resident_memory_gb()


UPKEEP_EVERY_S = 30.0  # how often a long loop's `Upkeep` acts (after its first pass)


class Upkeep:
    """The memory upkeep of a loop that runs XLA programs for as long as it lasts (the rollout engine's run of
    hundreds of episodes, the server): called on every pass, it acts on the first and then at most once every
    `every_s` seconds (`UPKEEP_EVERY_S` by default).

    It hands the freed heap back (`release_freed_memory`: programs of many shapes free arenas of many sizes, and
    the retained heap fragments until the free fragments outweigh what is in use; docs/design.md, "Runtime
    settings") and bounds the memory maps (`bound_memory_maps`: the process keeps every program it ran). Called
    from the loop's own thread, both fall between program runs."""

    def __init__(self, every_s: float | None = None, clock=time.monotonic):
        self.every_s, self._clock = UPKEEP_EVERY_S if every_s is None else every_s, clock
        self._last = float("-inf")

    def __call__(self) -> bool:
        """Does the upkeep on the first call and when `every_s` have passed since the last; returns whether it
        did."""
        if self._clock() - self._last < self.every_s:
            return False
        release_freed_memory()
        bound_memory_maps()
        self._last = self._clock()
        return True


def _glibc_function(name: str):
    """The C library's function `name` on Linux (None elsewhere, or where the library lacks it: musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def resident_memory_gb() -> float | None:
    """The process's resident set size in GB, from /proc (None elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="utf-8") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        return None


def peak_memory_gb() -> float:
    """The process's peak resident set size so far in GB (Linux reports ru_maxrss in kB)."""
    import resource  # noqa: PLC0415 (Unix only)

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the kernel's limit on them per process), from /proc (None elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            held = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count", encoding="utf-8") as f:
            return held, int(f.read())
    except (OSError, ValueError):
        return None


_maps_after_drop = [0]  # the maps this process held right after `bound_memory_maps`' last drop (0: none yet)


def bound_memory_maps(share: float = 0.5) -> bool:
    """Drops every compiled program (`jax.clear_caches`) once this process's memory maps are more than `share`
    of the way from what the last drop left (none at first) to the kernel's limit, so that maps which are not
    programs' cannot make it drop over and over; each program loads again from the compilation cache when next
    run. Returns whether it dropped them. It reads /proc/self/maps: a loop calls it through `Upkeep`.

    XLA:CPU maps every compiled kernel's code and data apart, and a process keeps every program it ran, so a
    long job meeting new shapes reaches the kernel's limit on maps (vm.max_map_count) and dies with "LLVM
    ERROR: Unable to allocate section memory". Dropping the programs frees their maps, and reloading them from
    the compilation cache is cheaper than compiling them (docs/design.md, "Runtime settings")."""
    maps = memory_maps()
    if maps is None or maps[0] <= _maps_after_drop[0] + share * (maps[1] - _maps_after_drop[0]):
        return False
    import jax  # noqa: PLC0415 (jobs call `retain_freed_memory` before JAX is imported)

    jax.clear_caches()
    _maps_after_drop[0] = memory_maps()[0]
    logging.info(
        "%d memory maps of the kernel's %d per process: dropped the compiled programs, %d maps left (they "
        "load again from the compilation cache; `sysctl -w vm.max_map_count=1048576` avoids the reloads)",
        *maps,
        _maps_after_drop[0],
    )
    return True


def computes_on_cpu(environ: Mapping[str, str] | None = None, installed: Iterable[str] | None = None) -> bool:
    """Whether JAX will compute on the CPU, decided without starting JAX: `JAX_PLATFORMS` names the
    CPU first, or (unset) no GPU or TPU plugin is installed (jax-cuda*/rocm*-plugin, libtpu)."""
    platforms = (os.environ if environ is None else environ).get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    if installed is None:
        installed = (d.metadata["Name"] or "" for d in importlib.metadata.distributions())
    accelerator = re.compile(r"jax-(cuda|rocm)\d*-plugin|libtpu(-nightly)?")
    return not any(accelerator.fullmatch(name.lower().replace("_", "-")) for name in installed)


def full_precision_matmuls(environ: Mapping[str, str] | None = None) -> bool:
    """Makes fp32 mean fp32 on a GPU or TPU, where JAX multiplies fp32 matrices at reduced precision by default
    (TF32 on NVIDIA GPUs, bf16 passes on TPUs). Measured on an H100: logits 3e-4 off the full-precision ones and
    41 of 127 core tests outside their 1e-4 / 1e-5 bounds, none of those bounds missed with this. Left alone where
    `JAX_DEFAULT_MATMUL_PRECISION` is set, and on the CPU, which multiplies fp32 in full anyway (so its compiled
    programs stay as they were). Returns whether it changed the setting."""
    environ = os.environ if environ is None else environ
    if environ.get("JAX_DEFAULT_MATMUL_PRECISION") or computes_on_cpu(environ):
        return False
    import jax  # noqa: PLC0415 (jobs call `retain_freed_memory` before JAX is imported)

    jax.config.update("jax_default_matmul_precision", "highest")
    return True


def cpu_name() -> str:
    """The CPU's model name: benchmark numbers depend on it (timings compare only on one kind)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def default_cache_dir() -> pathlib.Path:
    """`$TRACE_JAX_CACHE`, else `~/.cache/trace_jax`: converted models, built agents, compiled programs."""
    return pathlib.Path(os.environ.get("TRACE_JAX_CACHE") or pathlib.Path.home() / ".cache" / "trace_jax")


def compilation_cache_dir(environ: Mapping[str, str] | None = None) -> pathlib.Path:
    """Where compiled XLA programs persist between processes: `$JAX_COMPILATION_CACHE_DIR` when set,
    else a folder of the project's cache named after this machine's CPU and its instruction sets.

    XLA:CPU compiles for the host's instruction sets, so a folder shared by two kinds of CPU (a home
    folder that moves between machines) would offer each the other's programs; JAX's loader
    rejects those, but every program would then be compiled again on each switch."""
    environ = os.environ if environ is None else environ
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return pathlib.Path(environ["JAX_COMPILATION_CACHE_DIR"])
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    machine = hashlib.sha256(f"{platform.machine()} {cpu_name()} {flags}".encode()).hexdigest()[:16]
    return default_cache_dir() / "xla" / machine


def enable_compilation_cache() -> pathlib.Path:
    """Keeps every compiled program in `compilation_cache_dir()`, so a resumed job, a second evaluation or a
    rerun benchmark loads its programs instead of compiling them again. Every one, however fast it compiled: the
    small programs a run meets as it goes (a cache of a new size, a row move at a new window) would otherwise be
    compiled again by every run, and a run after a warm-up is to compile nothing."""
    import jax  # noqa: PLC0415 (jobs call `retain_freed_memory` before JAX is imported)

    folder = compilation_cache_dir()
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder


class ProgramLog:
    """The XLA programs built while it is open (`with ProgramLog() as log:`), by JAX's name for each:
    `compiled`, and `loaded` from the persistent compilation cache. JAX reports a load as a backend compile
    right after a cache hit on the same thread, so a count of compile events alone counts loads as compiles."""

    COMPILE = "/jax/core/compile/backend_compile_duration"
    CACHE_HIT = "/jax/compilation_cache/cache_hits"

    def __init__(self):
        self.compiled: Counter[str] = Counter()
        self.loaded: Counter[str] = Counter()
        self._hit = threading.local()

    def _event(self, name: str, **_) -> None:
        if name == self.CACHE_HIT:
            self._hit.pending = True

    def _duration(self, name: str, _seconds: float, fun_name: str = "?", **_) -> None:
        if name == self.COMPILE:
            (self.loaded if getattr(self._hit, "pending", False) else self.compiled).update([fun_name])
            self._hit.pending = False

    @property
    def built(self) -> int:
        """Programs compiled or loaded."""
        return self.compiled.total() + self.loaded.total()

    def __enter__(self) -> ProgramLog:
        import jax  # noqa: PLC0415 (see enable_compilation_cache)

        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        return self

    def __exit__(self, *_) -> None:
        import jax  # noqa: PLC0415

        jax.monitoring.unregister_event_listener(self._event)
        jax.monitoring.unregister_event_duration_listener(self._duration)
