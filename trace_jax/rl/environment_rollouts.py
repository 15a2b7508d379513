"""The GRPO job's rollout source for an environment (`config.env`): multi-turn episodes through the
rollout engine, scored by the environment's own evaluator.

A step plays each of the next `rollout.tasks_per_step` training tasks `rollout.group_size`
times at the rollout temperature (with `rollout.train_tasks`, the steps cycle through the split's
first that many); every trajectory becomes one learner sequence (the exact ids the agent saw,
the loss on its sampled turns, the sampler's logprobs). With `rollout.hint_share` > 0 (environments
that offer hints), the first hint_share x group_size episodes of each group (rounded half up) are
played with the task's hint in the system prompt, and their learner sequences are the unhinted rendering:
the hint is removed before the gradient, and the learner recomputes their old logprobs
(`learner.make_rescore_fn`). Held-out evaluation is the evaluation job's code path: greedy episodes
of `eval.split`, written to `eval/step_<k>.jsonl` with their per-family table (success with 95%
intervals, pass^1).
The base agent's evaluation may come from an evaluation job's workdir (`eval.base_run`) of the
same agent, tasks and limits: arms of one comparison then share it instead of replaying it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections import Counter
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from absl import logging

from trace_jax import distributed, lora
from trace_jax.agent.chat_codec import ChatCodec
from trace_jax.agent.episodes import (
    EPISODE_LIMITS,
    check_base_run,
    play,
    recorded_episodes,
    summarize_run,
    summary_scalars,
)
from trace_jax.agent.rollout import MODEL, EpisodeSpec, RolloutConfig, RolloutEngine, Trajectory
from trace_jax.envs import make_environment
from trace_jax.envs.base import TaskSpec
from trace_jax.envs.hints import hinted_trials, offers_hint
from trace_jax.models.tokenizer import ChatTokenizer
from trace_jax.rl.batching import LearnerSequence, StepRollouts
from trace_jax.rl.curriculum import climb, env_parts, start_state, with_levels
from trace_jax.rl.grpo_settings import EpisodeGrpoSettings
from trace_jax.sampling import Sampler


def trajectory_sequence(trajectory: Trajectory, advantage: float = 0.0) -> LearnerSequence:
    """The learner's view of a trajectory: its ids, the loss on the agent's sampled tokens, the
    sampler's logprobs, under the adapter it was played with."""
    return LearnerSequence(
        trajectory.token_ids, trajectory.loss_mask, trajectory.logprobs, advantage, trajectory.spec.adapter_idx
    )


def unhinted_sequence(trajectory: Trajectory, hinted_prompt: Sequence[int], prompt: Sequence[int]) -> LearnerSequence:
    """The learner row of an episode played with a hint: its ids with the agent's unhinted first prompt `prompt`
    in place of the hinted one it was fed (`hinted_prompt`), everything after (turns as sampled, observations)
    unchanged, and the loss mask and the sampler's (hinted) logprobs moved with them. Continuations never
    re-render the system prompt, so these are the ids of an unhinted episode with the same turns."""
    head = len(hinted_prompt)
    if list(trajectory.token_ids[:head]) != list(hinted_prompt) or any(trajectory.loss_mask[:head]):
        raise ValueError(f"episode {trajectory.spec.task.task_id} does not open with the hinted first prompt given")
    return LearnerSequence(
        list(prompt) + list(trajectory.token_ids[head:]),
        [0] * len(prompt) + list(trajectory.loss_mask[head:]),
        [0.0] * len(prompt) + list(trajectory.logprobs[head:]),
        0.0,
        trajectory.spec.adapter_idx,
        hinted=True,
    )


def hinted_per_group(rollout: ml_collections.ConfigDict) -> int:
    """How many episodes of each group are played with the task's hint (`hints.hinted_trials`)."""
    return hinted_trials(rollout.hint_share, rollout.group_size)


def hint_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """The share of episodes played with the hint, and the mean reward of those and of the others."""
    hinted = [t.outcome.reward for t in trajectories if t.spec.hint]
    unhinted = [t.outcome.reward for t in trajectories if not t.spec.hint]
    out = {f"{prefix}/hinted_share": len(hinted) / len(trajectories)}
    for name, rewards in (("hinted_reward", hinted), ("unhinted_reward", unhinted)):
        if rewards:
            out[f"{prefix}/{name}"] = float(np.mean(rewards))
    return out


def variant_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """Where the episodes span several task variants (a mixed capability environment's families): each variant's
    mean reward, and with hints that of its unhinted episodes (what the adapter does on its own), as
    "<prefix>/<variant>/reward" and "<prefix>/<variant>/unhinted_reward"."""
    by_variant: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_variant.setdefault(t.spec.task.family, []).append(t)
    if len(by_variant) < 2:
        return {}
    out = {}
    for variant, played in sorted(by_variant.items()):
        out[f"{prefix}/{variant}/reward"] = float(np.mean([t.outcome.reward for t in played]))
        unhinted = [t.outcome.reward for t in played if not t.spec.hint]
        if unhinted and len(unhinted) < len(played):
            out[f"{prefix}/{variant}/unhinted_reward"] = float(np.mean(unhinted))
    return out


def trajectory_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """Mean reward and success, reward components, turns, sampled tokens and end-reason shares."""
    n = len(trajectories)
    out = {
        f"{prefix}/reward": float(np.mean([t.outcome.reward for t in trajectories])),
        f"{prefix}/reward_std": float(np.std([t.outcome.reward for t in trajectories])),
        f"{prefix}/success": float(np.mean([t.outcome.success for t in trajectories])),
        f"{prefix}/turns": float(np.mean([t.num_turns for t in trajectories])),
        f"{prefix}/errors": float(np.mean([t.num_errors for t in trajectories])),
        f"{prefix}/generated_tokens": float(np.mean([t.generated_tokens for t in trajectories])),
    }
    for reason, count in Counter(t.end_reason for t in trajectories).items():
        out[f"{prefix}/end_{reason}"] = count / n
    for name in sorted({c for t in trajectories for c in t.outcome.components}):
        values = [t.outcome.components[name] for t in trajectories if name in t.outcome.components]
        out[f"{prefix}/component_{name}"] = float(np.mean(values))
    return out


class EnvironmentRollouts:
    """Training episodes and held-out evaluations of one environment, played by the sampler's model."""

    def __init__(
        self,
        config: EpisodeGrpoSettings,
        tokenizer: ChatTokenizer,
        num_train_tasks: int,
        workdir: pathlib.Path,
    ):
        self.config, self.tokenizer, self.workdir = config, tokenizer, workdir
        self.env = make_environment(config.env_config)
        self.hinted_per_group = hinted_per_group(config.rollout)
        if self.hinted_per_group and not hasattr(self.env, "hint_for"):
            raise ValueError(
                f"config.rollout.hint_share = {config.rollout.hint_share} is invalid here: the "
                f"environment of config.env (name = {config.env['name']!r}) offers no hints (the "
                "capability environments do); set it to 0.0"
            )
        self.num_train_tasks = num_train_tasks
        self.eval_env = self.env  # the held-out tasks stay the starting level's while a curriculum climbs
        self._set_train_tasks()
        self.heldout = self._heldout_tasks()
        self.curriculum = config.curriculum
        self.curriculum_state, self._tops = None, []
        if self.curriculum.patience:
            parts = env_parts(config.env_config)
            self.curriculum_state = start_state([p["difficulty"] for p in parts])
            built = [make_environment(ml_collections.ConfigDict(p)) for p in parts]
            self._tops = [0 if e.variant is not None else e.capability.max_difficulty for e in built]
        limits = {
            k: getattr(config.rollout, k) for k in ("batch_size", "max_turns", "max_tokens_per_turn", "max_errors")
        }
        self.train_rollout = RolloutConfig(**limits, temperature=config.rollout.temperature, top_p=config.rollout.top_p)
        self.eval_rollout = dataclasses.replace(
            self.train_rollout, batch_size=config.eval.batch_size, temperature=0.0, top_p=1.0
        )
        self.base_run = pathlib.Path(config.eval.base_run) if config.eval.base_run else None
        if self.base_run:
            check_base_run(self.base_run, self._base_evaluation(), "eval.base_run")

    def _base_evaluation(self) -> ml_collections.ConfigDict:
        """The evaluation job's config whose episodes are this job's held-out evaluation of the base agent."""
        config = self.config
        return ml_collections.ConfigDict(
            dict(
                model=config.model,
                dtype=config.dtype,
                adapter="",
                seed=config.seed,
                env={k: v for k, v in config.env.items() if k != "split"},  # the training split is not played
                split=config.eval.split,
                num_tasks=config.eval.num_tasks,
                trials=1,
                log_every_s=config.log_every_s,
                rollout={k: getattr(self.eval_rollout, k) for k in ("batch_size", *EPISODE_LIMITS)},
            )
        )

    def _seed_base_eval(self, episodes_path: pathlib.Path) -> None:
        """Starts the base agent's held-out episodes from `eval.base_run`'s (those of this job's tasks);
        `play` then plays only what it lacks."""
        if episodes_path.exists():
            return
        wanted = {task.task_id for task in self.heldout}
        records = [r for r in recorded_episodes(self.base_run / "episodes.jsonl") if r["task_id"] in wanted]
        episodes_path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")

    def _set_train_tasks(self) -> None:
        """The training tasks of the current environment, `num_train_tasks` of them (a finite set cycles)."""
        pool, num = self.config.rollout.train_tasks, self.num_train_tasks
        split = self.config.env["split"]
        available = self.env.tasks(split, num if pool is None else min(pool, num))
        if not available:
            raise ValueError(f"config.env.split = {split!r} has no tasks")
        self.train_tasks = [available[i % len(available)] for i in range(num)]
        self._train_reach = len(available)

    def _heldout_tasks(self) -> list:
        """The first `eval.num_tasks` tasks of `eval.split`; when that is the training split, the ones after every
        task training may draw (a run that keeps its best step by them never trained on them)."""
        split, num = self.config.eval.split, self.config.eval.num_tasks
        if split != self.config.env["split"]:
            return self.env.tasks(split, num)
        tasks = self.env.tasks(split, self._train_reach + num)[self._train_reach :]
        if len(tasks) < num:
            raise ValueError(
                f"config.eval.split = {split!r} is the training split, and only {len(tasks)} of its tasks are left "
                f"after the {self._train_reach} training may draw, fewer than config.eval.num_tasks = {num}; name "
                "another split, or fewer training tasks (config.rollout.train_tasks)"
            )
        return tasks

    def restore(self, cursor: dict) -> None:
        """Takes up the curriculum where a checkpoint's `cursor` left it."""
        if self.curriculum_state is not None and "curriculum" in cursor:
            self._move_to(cursor["curriculum"])

    def _move_to(self, state: dict) -> None:
        if state["levels"] != self.curriculum_state["levels"]:
            self.env = make_environment(with_levels(self.config.env_config, state["levels"]))
            self._set_train_tasks()
        self.curriculum_state = state

    def follow(self, rollouts: StepRollouts) -> dict[str, float]:
        """The curriculum's step (`trace_jax.rl.curriculum`) on a step's training rewards, each part's from its own
        tasks' episodes; "curriculum/level_<i>" metrics (none when off)."""
        if self.curriculum_state is None:
            return {}
        part_of = getattr(self.env, "part_index", lambda task_id: 0)
        rewards: list[list[float]] = [[] for _ in self._tops]
        for record in rollouts.records:
            rewards[part_of(record["task_id"])].append(record["reward"])
        state, moved = climb(
            self.curriculum_state, [float(np.mean(r)) if r else None for r in rewards], self._tops, self.curriculum
        )
        self._move_to(state)
        for i in moved:
            logging.info("curriculum: part %d moved to difficulty %s", i, state["levels"][i])
        return {f"curriculum/level_{i}": float(level) for i, level in enumerate(state["levels"])}

    def _engine(self, sampler: Sampler, rollout: RolloutConfig, env=None) -> RolloutEngine:
        return RolloutEngine(
            env or self.env, agent=MODEL, user=MODEL, sampler=sampler, tokenizer=self.tokenizer, config=rollout
        )

    def sample(
        self, sampler: Sampler, first_task: int, key: jax.Array, adapter_idx: int, num_tasks: int | None = None
    ) -> StepRollouts:
        """`group_size` episodes of each of the next `num_tasks` (default `tasks_per_step`) training tasks (a
        group's episodes adjacent), the first `hinted_per_group` of each played with the hint and learned from
        without it."""
        rollout_cfg = self.config.rollout
        tasks = self.train_tasks[first_task : first_task + (num_tasks or rollout_cfg.tasks_per_step)]
        hinted = {task.task_id for task in tasks if self.hinted_per_group and offers_hint(self.env, task)}
        specs = [
            EpisodeSpec(task, trial, adapter_idx, hint=trial < self.hinted_per_group and task.task_id in hinted)
            for task in tasks
            for trial in range(rollout_cfg.group_size)
        ]
        engine = self._engine(sampler, self.train_rollout)
        trajectories = distributed.run_shared(lambda share: engine.run(share, key=key), specs)
        prompts = {task.task_id: self.first_prompts(task) for task in tasks if task.task_id in hinted}
        sequences = [
            unhinted_sequence(t, *prompts[t.spec.task.task_id]) if t.spec.hint else trajectory_sequence(t)
            for t in trajectories
        ]
        rewards = np.array([t.outcome.reward for t in trajectories], np.float64)
        groups = np.repeat(np.arange(len(tasks)), rollout_cfg.group_size)
        metrics = trajectory_metrics(trajectories, "rollout") | variant_metrics(trajectories, "rollout")
        if self.hinted_per_group:
            metrics.update(hint_metrics(trajectories, "rollout"))
        return StepRollouts(sequences, rewards, groups, metrics, [t.record() for t in trajectories])

    def first_prompts(self, task: TaskSpec) -> tuple[list[int], list[int]]:
        """The agent's first prompt of `task` (the ids the engine feeds it first), with the hint and without."""
        hinted, plain = self.env.episode(task, hint=True), self.env.episode(task)
        codec = ChatCodec(self.tokenizer, plain.tools)
        return codec.first_prompt(hinted.reset()), codec.first_prompt(plain.reset())

    def evaluate(self, sampler: Sampler, adapter_idx: int, step: int) -> dict[str, float]:
        """Greedy held-out episodes through the evaluation job's path; "eval/..." metrics (overall and
        per family), with the episodes and the table written under <workdir>/eval/."""
        folder = self.workdir / "eval"
        folder.mkdir(exist_ok=True)
        specs = [EpisodeSpec(task, 0, adapter_idx) for task in self.heldout]
        episodes_path = folder / f"step_{step}.jsonl"
        if self.base_run and adapter_idx == lora.NO_ADAPTER:
            distributed.on_main(lambda: self._seed_base_eval(episodes_path))
        records = play(
            self._engine(sampler, self.eval_rollout, self.eval_env),
            specs,
            key=jax.random.key(0),
            episodes_path=episodes_path,
            log_every_s=self.config.log_every_s,
        )
        summary, table = summarize_run(records, trials=1)
        if distributed.is_main():
            (folder / f"step_{step}.md").write_text(table + "\n", encoding="utf-8")
        return summary_scalars(summary)

    def summary(self, base: dict[str, float], final: dict[str, float]) -> dict:
        """The spec summary's held-out entries: mean reward and success, before and after."""
        return {
            "base_reward": base["eval/reward"],
            "final_reward": final["eval/reward"],
            "base_success": base["eval/success"],
            "final_success": final["eval/success"],
        }
