"""An environment whose agent reads a guidance text at the end of its system prompt (GEPA's optimised prompts).

GEPA optimises text, not weights: a candidate guidance is played by wrapping the environment, and
the texts it found are evaluated on the target the same way (`env.guidance` in a job's config).
Everything else (tasks, tools, the user simulator, scoring) is the wrapped environment's.
"""

from __future__ import annotations

from trace_jax.envs.base import Environment, Episode, Message, TaskSpec


def with_guidance(messages: list[Message], guidance: str) -> list[Message]:
    """`messages` with `guidance` appended to the system prompt (a blank line between them)."""
    if not messages or messages[0]["role"] != "system":
        raise ValueError("guidance goes after a system prompt, and these messages open without one")
    return [{**messages[0], "content": f"{messages[0]['content']}\n\n{guidance}"}, *messages[1:]]


class GuidedEpisode:
    """An episode of the wrapped environment whose opening system prompt ends with `guidance`."""

    def __init__(self, episode: Episode, guidance: str):
        self._episode = episode
        self.guidance = guidance

    def reset(self) -> list[Message]:
        return with_guidance(self._episode.reset(), self.guidance)

    def __getattr__(self, name: str):  # task, tools, step, evaluate, ...: the wrapped episode's
        return getattr(self._episode, name)


class GuidedEnvironment:
    """`env` with `guidance` at the end of every episode's system prompt ("" leaves episodes unchanged)."""

    def __init__(self, env: Environment, guidance: str):
        self.env = env
        self.guidance = guidance
        self.name = env.name

    def tasks(self, split: str, num: int | None = None) -> list[TaskSpec]:
        return self.env.tasks(split, num)

    def episode(self, task: TaskSpec, **options) -> Episode:
        episode = self.env.episode(task, **options)
        return GuidedEpisode(episode, self.guidance) if self.guidance else episode

    def __getattr__(self, name: str):  # hint, scenario, system_prompt, ...: the wrapped environment's
        return getattr(self.env, name)
