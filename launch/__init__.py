"""absl entry points, one per job (`python -m launch.<job>`).

Importing the package applies the process-wide runtime settings first
(`trace_jax.runtime.retain_freed_memory`, then the persistent compilation cache and full-precision
fp32 matmuls on accelerators), so every job starts with them.
"""

from trace_jax.runtime import enable_compilation_cache, full_precision_matmuls, retain_freed_memory

retain_freed_memory()
enable_compilation_cache()
full_precision_matmuls()
