"""Built-in capability environments over the retail domain (TRACE stage 2), by capability name: one
for each capability of the programmatic analyst (`trace_jax.trace.programmatic_analyst`)."""

from trace_jax.envs.capability.communication import COMMUNICATION
from trace_jax.envs.capability.environment import Capability, CapabilityEnvironment
from trace_jax.envs.capability.error_recovery import ERROR_RECOVERY
from trace_jax.envs.capability.multi_step import MULTI_STEP
from trace_jax.envs.capability.precondition import PRECONDITION
from trace_jax.envs.capability.structured_data import STRUCTURED_DATA
from trace_jax.envs.capability.tool_calling import TOOL_CALLING

CAPABILITIES: dict[str, Capability] = {
    c.name: c for c in (TOOL_CALLING, STRUCTURED_DATA, MULTI_STEP, PRECONDITION, COMMUNICATION, ERROR_RECOVERY)
}

__all__ = ["CAPABILITIES", "Capability", "CapabilityEnvironment"]
