"""Single-turn rollouts of verifiable tasks: render each task's prompt, sample, score.

Used both to collect GRPO groups (several samples per task) and to evaluate an adapter
(one greedy sample per task). Prompts are generated in chunks of `batch_size` rows to
bound the KV cache; each chunk draws with its own key folded from `key`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import ModuleType

import jax
import numpy as np

from trace_jax.models.tokenizer import ChatTokenizer
from trace_jax.sampling import Completion, Sampler


@dataclasses.dataclass(frozen=True)
class ScoredRollouts:
    """Row i: prompt tokens, completion, reward and task diagnostics; group_ids[i] is its task's index."""

    prompts: list[list[int]]
    completions: list[Completion]
    rewards: np.ndarray
    group_ids: np.ndarray
    diagnostics: list[dict]

    def summary(self, prefix: str) -> dict[str, float]:
        """Mean reward and completion length, and the mean of every numeric task diagnostic."""
        lengths = np.array([len(c.token_ids) for c in self.completions], np.float64)
        out = {f"{prefix}/reward": float(self.rewards.mean()), f"{prefix}/reward_std": float(self.rewards.std()),
               f"{prefix}/completion_tokens": float(lengths.mean()),
               f"{prefix}/truncated": float(np.mean([c.finish_reason != "stop" for c in self.completions]))}
        numeric = {k for d in self.diagnostics for k, v in d.items() if isinstance(v, (bool, int, float))}
        for name in sorted(numeric):
            out[f"{prefix}/{name}"] = float(np.mean([float(d[name]) for d in self.diagnostics if name in d]))
        return out


def rollout(sampler: Sampler, tokenizer: ChatTokenizer, task_set: ModuleType, tasks: Sequence, *, key: jax.Array,
            group_size: int = 1, adapter_idx: int, temperature: float, top_p: float = 1.0, max_new_tokens: int,
            batch_size: int | None = None) -> ScoredRollouts:
    """`group_size` samples of every task (rows of one task are adjacent), each scored by `task_set.reward`."""
    rendered = [tokenizer.apply_chat(task.messages, tools=task.tools) for task in tasks]  # once per task
    prompts = [prompt for prompt in rendered for _ in range(group_size)]
    owners = [task for task in tasks for _ in range(group_size)]
    batch_size = batch_size or len(prompts)
    completions: list[Completion] = []
    for chunk, start in enumerate(range(0, len(prompts), batch_size)):
        outs, _ = sampler.generate(prompts[start : start + batch_size], key=jax.random.fold_in(key, chunk),
                                   max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                   adapter_idx=adapter_idx, stop_token_ids=sorted(tokenizer.eos_token_ids))
        completions.extend(outs)
    scored = [task_set.reward(task, completion.text) for task, completion in zip(owners, completions)]
    return ScoredRollouts(prompts, completions, np.array([s for s, _ in scored], np.float64),
                          np.repeat(np.arange(len(tasks)), group_size), [d for _, d in scored])
