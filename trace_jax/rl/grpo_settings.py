"""The GRPO job's config, typed: the blocks of a job on an environment's episodes (`config.env`) or on a task
set's single-turn completions (`config.task`), each key with what it must be (`trace_jax.settings`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from trace_jax.rl.advantages import ADVANTAGE_ESTIMATORS
from trace_jax.rl.curriculum import CurriculumConfig
from trace_jax.rl.job import JobSettings, TrainSettings
from trace_jax.rl.losses import AGGREGATIONS
from trace_jax.sampling.sampler import POLICIES
from trace_jax.settings import (
    REQUIRED,
    Invalid,
    is_bool,
    is_dict,
    non_negative_int,
    non_negative_number,
    none_or,
    nonempty_str,
    number,
    positive_int,
    positive_number,
    setting,
    share,
)
from trace_jax.tasks import TASK_SETS


def _fractions(value: Any) -> bool:
    return isinstance(value, tuple) and all(number(f) and 0 < f < 1 for f in value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrpoTrainSettings(TrainSettings):
    steps: int | None = setting(REQUIRED, "None (use train.rollout_budget) or a positive int", none_or(positive_int))
    rollout_budget: int | None = setting(
        REQUIRED,
        "None (use train.steps) or a positive int (training episodes in all)",
        none_or(positive_int),
    )
    updates_per_step: int = setting(
        REQUIRED,
        "a positive int (optimizer updates a step, each on its share of the step's micro-batches)",
        positive_int,
    )
    snapshot_fractions: tuple[float, ...] = setting(
        REQUIRED,
        "a tuple of fractions in (0, 1): the adapter is also exported at these shares of the steps (may be ())",
        _fractions,
    )
    target_kl: float | None = setting(
        None,
        "None (every update applied) or a number > 0: a step's updates stop at the first mini-batch whose approx KL "
        "to the sampling policy is above it (`learner.make_train_step`)",
        none_or(positive_number),
        optional=True,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrpoRolloutSettings:
    """The `rollout` block's keys of either kind of job."""

    tasks_per_step: int = setting(REQUIRED, "a positive int", positive_int)
    group_size: int = setting(
        REQUIRED, "an int >= 2 (advantages compare a group)", lambda v: positive_int(v) and v >= 2
    )
    temperature: float = setting(REQUIRED, "> 0 (the learner trains the policy at this temperature)", positive_number)
    top_p: float = setting(
        REQUIRED,
        "1.0: the sampler's logprobs serve as the old policy's, and truncation would make them differ",
        lambda v: v == 1.0,
    )
    batch_size: int = setting(REQUIRED, "a positive int (rows sampled at once)", positive_int)
    min_shared_prefix: int | None = setting(
        REQUIRED, "None or an int >= 1", lambda v: v is None or (isinstance(v, int) and v >= 1)
    )
    resamples: int = setting(
        0, "an int >= 0: rounds of re-sampling a step's constant groups (0: none)", non_negative_int, optional=True
    )
    min_informative: float = setting(
        0.5, "a number in [0, 1]: the share of varying groups re-sampling stops at", share, optional=True
    )
    sampler_policy: str | None = setting(
        None,
        f"None (by backend) or one of {POLICIES}: how the sampler schedules rows",
        none_or(lambda v: v in POLICIES),
        optional=True,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeRolloutSettings(GrpoRolloutSettings):
    """An environment job's `rollout` block: its episodes' limits and hints."""

    max_turns: int = setting(REQUIRED, "a positive int", positive_int)
    max_tokens_per_turn: int = setting(REQUIRED, "a positive int", positive_int)
    max_errors: int = setting(REQUIRED, "an int >= 0", non_negative_int)
    train_tasks: int | None = setting(
        REQUIRED,
        "None (the next tasks of the split every step) or a positive int (the steps cycle through the split's "
        "first train_tasks tasks)",
        none_or(positive_int),
    )
    hint_share: float = setting(
        REQUIRED,
        "a number in [0, 1]: the share of each group's episodes played with the environment's hint (0: none)",
        share,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompletionRolloutSettings(GrpoRolloutSettings):
    """A task-set job's `rollout` block."""

    max_new_tokens: int = setting(REQUIRED, "a positive int", positive_int)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrpoLossSettings:
    aggregation: str = setting(REQUIRED, f"one of {sorted(AGGREGATIONS)}", lambda v: v in AGGREGATIONS)
    eps_low: float = setting(REQUIRED, "in [0, 1)", lambda v: number(v) and 0 <= v < 1)
    eps_high: float = setting(REQUIRED, "in (0, 1]", lambda v: number(v) and 0.0 < v <= 1.0)
    kl_coef: float = setting(REQUIRED, ">= 0", non_negative_number)
    negative_advantage_scale: float = setting(
        1.0,
        "a number in [0, 1]: the weight of the advantages below zero (`losses.LossConfig.negative_advantage_scale`; "
        "1: GRPO, 0: only the rows better than their group learned)",
        share,
        optional=True,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeLossSettings(GrpoLossSettings):
    tis_cap: float | None = setting(
        REQUIRED,
        "None (hinted rows learned as on-policy ones) or a number >= 1: the cap of a hinted token's importance "
        "weight (an unhinted token's is 1)",
        lambda v: v is None or (number(v) and v >= 1.0),
    )
    hinted_eps_high: float | None = setting(
        None,
        "None (hinted rows clipped as the others) or a number >= 0: a hinted token's ratio is clipped above at "
        "1 + this (`losses.LossConfig.hinted_eps_high`; inf: not clipped above)",
        lambda v: v is None or non_negative_number(v),
    )
    hinted_sft_coef: float = setting(
        0.0,
        "a number >= 0: the weight of the imitation term on the hinted rows better than their group "
        "(`losses.LossConfig.hinted_sft_coef`; 0: none)",
        non_negative_number,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrpoEvalSettings:
    num_tasks: int = setting(REQUIRED, "an int >= 0 (0: no held-out evaluation)", non_negative_int)
    every: int = setting(REQUIRED, "a positive int", positive_int)
    batch_size: int = setting(REQUIRED, "a positive int", positive_int)
    keep_best: bool = setting(
        False,
        "a bool: export the evaluated step's adapter with the highest held-out reward, step 0 (no change to the "
        "model) included, instead of the last step's (`trace_jax.rl.best_adapter`)",
        is_bool,
        optional=True,
    )

    def __post_init__(self):
        if self.keep_best and self.num_tasks == 0:
            raise Invalid("keep_best", "False when num_tasks is 0 (no held-out evaluation to choose a step by)")


TIES = ("earlier", "gold_logp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeEvalSettings(GrpoEvalSettings):
    split: str = setting(REQUIRED, "the environment's held-out split", nonempty_str)
    base_run: str = setting(
        REQUIRED,
        "\"\" (play the base agent's held-out episodes) or an evaluation job's workdir to read them from",
        lambda v: isinstance(v, str),
    )
    ties: str = setting(
        "earlier",
        f"one of {TIES}: where `keep_best` chooses a step, which of two of the same held-out reward is kept, the "
        "earlier or the one whose policy finds the held-out tasks' gold turns likelier "
        "(`trace_jax.rl.gold_likelihood`, logged as eval/gold_logp with every evaluation)",
        lambda v: v in TIES,
        optional=True,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompletionEvalSettings(GrpoEvalSettings):
    splits: tuple[str, ...] = setting(
        REQUIRED,
        "a non-empty tuple of the task set's held-out split names",
        lambda v: isinstance(v, tuple) and len(v) >= 1 and all(isinstance(x, str) for x in v),
    )
    max_new_tokens: int = setting(REQUIRED, "a positive int", positive_int)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrpoSettings(JobSettings):
    """What a GRPO job's config holds, either kind."""

    train: GrpoTrainSettings
    advantage: str = setting(REQUIRED, f"one of {sorted(ADVANTAGE_ESTIMATORS)}", lambda v: v in ADVANTAGE_ESTIMATORS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeGrpoSettings(GrpoSettings):
    """GRPO on an environment's episodes (`config.env`)."""

    env: dict = setting(REQUIRED, "an environment block (`trace_jax.envs`)", is_dict)
    eval: EpisodeEvalSettings
    rollout: EpisodeRolloutSettings
    loss: EpisodeLossSettings
    curriculum: CurriculumConfig = dataclasses.field(default_factory=CurriculumConfig, metadata={"optional": True})

    @property
    def env_config(self) -> ml_collections.ConfigDict:
        """The `env` block as the environments take it."""
        return ml_collections.ConfigDict(self.env)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompletionGrpoSettings(GrpoSettings):
    """GRPO on a task set's single-turn completions (`config.task`)."""

    task: str = setting(REQUIRED, f"one of {sorted(TASK_SETS)} (or give config.env instead)", lambda v: v in TASK_SETS)
    rollout: CompletionRolloutSettings
    loss: GrpoLossSettings
    eval: CompletionEvalSettings
