"""How likely the policy finds the gold agent's turns on held-out tasks: learning that greedy success cannot see.

A skill the agent lacks is learned by degrees: the write it never made becomes likelier (that a call follows the
look-ups, then the tool's name, then each argument) long before it is the greedy choice, and all that while a
held-out evaluation by greedy success reports the base's score. The gold agent's episodes of the held-out tasks
(`envs.scripted.GoldAgent`: the gold calls one a turn, then the facts), recorded as the model's tokens in the
unhinted context, and the policy's log-probability of those turns, summed per task and averaged over the tasks,
measure that progress on tasks training never drew. A GRPO job with `eval.ties = "gold_logp"` logs it with each
held-out evaluation ("eval/gold_logp") and breaks ties of the held-out reward with it (`best_adapter`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from trace_jax.agent.rollout import EpisodeSpec, RolloutConfig, RolloutEngine, Trajectory
from trace_jax.envs.scripted import GoldAgent, ScriptedUser
from trace_jax.lora import NO_ADAPTER
from trace_jax.models.config import ModelConfig
from trace_jax.models.tokenizer import ChatTokenizer
from trace_jax.rl.batching import LearnerSequence, pack_sequences
from trace_jax.rl.learner import frozen_inputs, make_sequence_logprob_fn
from trace_jax.sharding import ShardingPlan

GOLD_MAX_TURNS = 64  # room for every gold call of a task and its closing turn


def gold_trajectories(env, tokenizer: ChatTokenizer, tasks, max_turns: int, adapter_idx: int) -> list[Trajectory]:
    """The gold agent's episodes of `tasks`, recorded as the model's tokens (scripted user where one is needed),
    each under adapter `adapter_idx`."""
    config = RolloutConfig(batch_size=64, max_turns=max_turns, max_tokens_per_turn=1 << 30)
    engine = RolloutEngine(
        env, agent=GoldAgent(), user=ScriptedUser(user_actions=True), tokenizer=tokenizer, config=config
    )
    return engine.run([EpisodeSpec(task, adapter_idx=adapter_idx) for task in tasks], key=jax.random.key(0))


class GoldLikelihood:
    """The mean over `tasks` of log p(gold turns | their context) under the base model or an adapter.

    The gold episodes are played and packed once, here (one shared head: the system prompt), with the residual
    streams entering the first adapted layer (`lora.first_layer` = `frozen_layers`), which no adapter changes;
    each call runs the adapted layers alone over them, the frozen base `params` with the adapter weights given."""

    def __init__(
        self,
        env,
        tokenizer: ChatTokenizer,
        tasks,
        params,
        cfg: ModelConfig,
        *,
        token_budget: int,
        frozen_layers: int = 0,
        row_multiple: int = 1,
        min_shared_prefix: int = 64,
        plan: ShardingPlan | None = None,
        remat: bool = False,
    ):
        if not tasks:
            raise ValueError("no held-out task to measure the gold turns' likelihood on")
        sequences = [
            LearnerSequence(t.token_ids, t.loss_mask, [0.0] * len(t.token_ids), adapter_idx=NO_ADAPTER)
            for t in gold_trajectories(env, tokenizer, tasks, GOLD_MAX_TURNS, NO_ADAPTER)
        ]
        self._num = len(sequences)
        batch = pack_sequences(
            sequences,
            token_budget=token_budget,
            row_multiple=row_multiple,
            min_shared_prefix=min_shared_prefix,
            pad_id=tokenizer.pad_token_id,
        )
        self._batch = frozen_inputs(params, cfg, frozen_layers, batch, remat=remat) if frozen_layers else batch
        self._logprob = make_sequence_logprob_fn(cfg, plan=plan, remat=remat, frozen_layers=frozen_layers)

    def __call__(self, params, adapter_weights, scale, adapter_idx: int) -> float:
        """The mean summed logprob of the gold turns, under adapter `adapter_idx` of `adapter_weights` (NO_ADAPTER:
        the base model)."""
        return float(np.mean(self.per_task(params, adapter_weights, scale, adapter_idx)))

    def per_task(self, params, adapter_weights, scale, adapter_idx: int) -> np.ndarray:
        """Each task's summed logprob of its gold turns (in the order of `tasks`)."""
        batch = self._batch
        micro_batches = tuple(
            mb.replace(adapter_idx=np.full_like(mb.adapter_idx, adapter_idx)) for mb in batch.micro_batches
        )
        prefix = batch.prefix
        if prefix is not None:
            prefix = prefix.replace(adapter=np.full_like(prefix.adapter, adapter_idx))
        batch = dataclasses.replace(batch, micro_batches=micro_batches, prefix=prefix)
        return self._logprob(params, adapter_weights, scale, batch, self._num)
