"""Single-turn rollouts of verifiable tasks: render each task's prompt, sample, score.

Used both to collect GRPO groups (several samples per task) and to evaluate an adapter
(one greedy sample per task); `TaskSetRollouts` is the GRPO job's source for a task set.
Prompts are generated in chunks of `batch_size` rows to bound the KV cache; sample i draws from
random stream i, and in a run of several processes each samples its share of the rows
(`trace_jax.distributed`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import ModuleType

import jax
import numpy as np

from trace_jax import distributed
from trace_jax.models.tokenizer import ChatTokenizer
from trace_jax.rl.batching import LearnerSequence, StepRollouts
from trace_jax.sampling import Completion, Sampler
from trace_jax.tasks import TASK_SETS


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
        out = {
            f"{prefix}/reward": float(self.rewards.mean()),
            f"{prefix}/reward_std": float(self.rewards.std()),
            f"{prefix}/completion_tokens": float(lengths.mean()),
            f"{prefix}/truncated": float(np.mean([c.finish_reason != "stop" for c in self.completions])),
        }
        numeric = {k for d in self.diagnostics for k, v in d.items() if isinstance(v, (bool, int, float))}
        for name in sorted(numeric):
            out[f"{prefix}/{name}"] = float(np.mean([float(d[name]) for d in self.diagnostics if name in d]))
        return out


def rollout(
    sampler: Sampler,
    tokenizer: ChatTokenizer,
    task_set: ModuleType,
    tasks: Sequence,
    *,
    key: jax.Array,
    group_size: int = 1,
    adapter_idx: int,
    temperature: float,
    top_p: float = 1.0,
    max_new_tokens: int,
    batch_size: int | None = None,
) -> ScoredRollouts:
    """`group_size` samples of every task (rows of one task are adjacent), each scored by `task_set.reward`; sample
    i draws from random stream i, so what is sampled does not depend on `batch_size`."""
    rendered = [tokenizer.apply_chat(task.messages, tools=task.tools) for task in tasks]  # once per task
    prompts = [prompt for prompt in rendered for _ in range(group_size)]
    owners = [task for task in tasks for _ in range(group_size)]
    batch_size = batch_size or len(prompts)

    def generate(rows: list[int]) -> list[Completion]:
        completions = []
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            outs, _ = sampler.generate(
                [prompts[i] for i in chunk],
                key=key,
                stream=chunk,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                adapter_idx=adapter_idx,
                stop_token_ids=sorted(tokenizer.eos_token_ids),
            )
            completions.extend(outs)
        return completions

    completions = distributed.run_shared(generate, list(range(len(prompts))))  # each process its share of rows
    scored = [task_set.reward(task, completion.text) for task, completion in zip(owners, completions)]
    return ScoredRollouts(
        prompts,
        completions,
        np.array([s for s, _ in scored], np.float64),
        np.repeat(np.arange(len(tasks)), group_size),
        [d for _, d in scored],
    )


class TaskSetRollouts:
    """The GRPO job's rollout source for a single-turn task set (`config.task`): groups of sampled
    completions of its training tasks, greedy held-out evaluation on `config.eval.splits`."""

    def __init__(self, config, tokenizer: ChatTokenizer, num_train_tasks: int):
        self.config, self.tokenizer = config, tokenizer
        self.task_set = TASK_SETS[config.task]
        self.train_tasks = self.task_set.make_tasks("train", num_train_tasks, config.seed)
        self.heldout = {
            split: self.task_set.make_tasks(split, config.eval.num_tasks, config.seed) for split in config.eval.splits
        }

    def sample(
        self, sampler: Sampler, first_task: int, key: jax.Array, adapter_idx: int, num_tasks: int | None = None
    ) -> StepRollouts:
        """`group_size` completions of each of the next `num_tasks` (default `tasks_per_step`) training
        tasks."""
        rollout_cfg = self.config.rollout
        tasks = self.train_tasks[first_task : first_task + (num_tasks or rollout_cfg.tasks_per_step)]
        scored = rollout(
            sampler,
            self.tokenizer,
            self.task_set,
            tasks,
            key=key,
            group_size=rollout_cfg.group_size,
            adapter_idx=adapter_idx,
            temperature=rollout_cfg.temperature,
            top_p=rollout_cfg.top_p,
            max_new_tokens=rollout_cfg.max_new_tokens,
            batch_size=rollout_cfg.batch_size,
        )
        sequences = [
            LearnerSequence.completion(p, c.token_ids, c.logprobs, adapter_idx=adapter_idx)
            for p, c in zip(scored.prompts, scored.completions)
        ]
        return StepRollouts(sequences, scored.rewards, scored.group_ids, scored.summary("rollout"))

    def evaluate(self, sampler: Sampler, adapter_idx: int, step: int) -> dict[str, float]:
        """Metrics of one greedy completion per held-out task, for each split: the first split's as
        "eval/...", the others' as "eval_<split>/..."."""
        del step
        metrics = {}
        for index, (split, tasks) in enumerate(self.heldout.items()):
            scored = rollout(
                sampler,
                self.tokenizer,
                self.task_set,
                tasks,
                key=jax.random.key(0),
                adapter_idx=adapter_idx,
                temperature=0.0,
                max_new_tokens=self.config.eval.max_new_tokens,
                batch_size=self.config.eval.batch_size,
            )
            metrics.update(scored.summary("eval" if index == 0 else f"eval_{split}"))
        return metrics

    def summary(self, base: dict[str, float], final: dict[str, float]) -> dict:
        """The job summary's held-out entries: the first split's reward, then the others'."""
        out = {"base_reward": base["eval/reward"], "final_reward": final["eval/reward"]}
        for split in self.config.eval.splits[1:]:
            out[f"base_reward_{split}"] = base[f"eval_{split}/reward"]
            out[f"final_reward_{split}"] = final[f"eval_{split}/reward"]
        return out
