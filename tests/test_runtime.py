"""The process-wide malloc setting applies only where JAX computes on the CPU (on GPU and TPU hosts
it serialises XLA's compile threads)."""

from trace_jax.runtime import computes_on_cpu


def test_the_cpu_is_recognised_from_the_platforms_variable_or_the_installed_plugins():
    assert computes_on_cpu({}, ["jax", "jaxlib", "numpy"])
    assert not computes_on_cpu({}, ["jax", "jax-cuda13-plugin", "jax-cuda13-pjrt"])
    assert not computes_on_cpu({}, ["jax_rocm7_plugin"]) and not computes_on_cpu({}, ["libtpu"])
    assert computes_on_cpu({"JAX_PLATFORMS": "cpu"}, ["jax-cuda12-plugin"])  # a GPU build asked to run on the CPU
    assert not computes_on_cpu({"JAX_PLATFORMS": "cuda,cpu"}, ["jax"])
