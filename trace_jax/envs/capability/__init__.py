"""Built-in capability environments over the retail domain (TRACE stage 2), by capability name."""

from trace_jax.envs.capability.environment import Capability, CapabilityEnvironment
from trace_jax.envs.capability.tool_calling import TOOL_CALLING

CAPABILITIES: dict[str, Capability] = {c.name: c for c in (TOOL_CALLING,)}

__all__ = ["CAPABILITIES", "Capability", "CapabilityEnvironment"]
