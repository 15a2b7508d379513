"""Token fidelity of recorded trajectories: the ids are what the model saw, and they say what the messages say.

SmolLM2 plays a few embedded-retail tickets (τ²'s real retail tools) through the rollout
engine at temperature 1. Re-scoring each trajectory's token ids as the learner gets them
(shared head run once, rows packed by a token budget) must reproduce the sampler's logprobs
on every sampled token, and decoding the ids must give back the conversation: each sampled span is its
assistant message, and the whole is the chat rendering of the messages.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import tau2  # noqa: F401 - a missing τ² fails the suite instead of skipping it

from trace_jax.agent.rollout import MODEL, EpisodeSpec, RolloutConfig, RolloutEngine
from trace_jax.envs.embedded_retail import EmbeddedRetail
from trace_jax.rl.batching import pack_sequences
from trace_jax.rl.environment_rollouts import trajectory_sequence
from trace_jax.rl.learner import token_logprobs
from trace_jax.sampling import Sampler

pytestmark = pytest.mark.optimized_xla  # SmolLM2 runs long here (tests/conftest.py)

TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def env():
    return EmbeddedRetail(seed=0)


@pytest.fixture(scope="module")
def trajectories(smollm2, env):
    sampler = Sampler(smollm2.cfg, smollm2.params, detokenize=smollm2.tokenizer.decode)
    config = RolloutConfig(batch_size=2, max_turns=3, max_tokens_per_turn=40, temperature=TEMPERATURE)
    engine = RolloutEngine(env, agent=MODEL, user=MODEL, sampler=sampler, tokenizer=smollm2.tokenizer, config=config)
    return engine.run([EpisodeSpec(task) for task in env.tasks("heldout", 2)], key=jax.random.key(3))


def _sampled_spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in the loss mask: one per sampled assistant turn."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_learner_batches_of_the_trajectories_reproduce_the_sampler_logprobs(smollm2, trajectories):
    """The trajectories as the learner gets them (the shared head cut off and run once, rows packed into
    micro-batches by a token budget): its logprobs on the loss tokens are the sampler's, and the loss
    mask covers exactly the agent's sampled tokens."""
    batch = pack_sequences(
        [trajectory_sequence(t, advantage=i) for i, t in enumerate(trajectories)], token_budget=1, min_shared_prefix=64
    )  # one row per micro-batch
    assert len(batch.micro_batches) == len(trajectories)
    cut = int(batch.prefix.lengths[0])
    rescore = jax.jit(token_logprobs, static_argnames=("cfg", "temperature"))
    for mb in batch.micro_batches:
        trajectory = trajectories[int(mb["advantages"][0])]
        row = np.asarray(
            rescore(
                smollm2.params,
                None,
                mb["tokens"],
                mb["adapter_idx"],
                cfg=smollm2.cfg,
                prefix=batch.prefix,
                prefix_of_row=mb["prefix_of_row"],
                temperature=TEMPERATURE,
            )
        )[0]
        scored = mb["loss_positions"][0][mb["loss_mask"][0] > 0]
        sampled = np.flatnonzero(trajectory.loss_mask)
        assert (scored + cut + 1).tolist() == sampled.tolist()
        assert len(sampled) == trajectory.generated_tokens > 0
        diff = np.abs(row[scored] - np.asarray(trajectory.logprobs)[sampled]).max()
        print(
            f"\n[token fidelity] {trajectory.spec.task.task_id}: {len(trajectory.token_ids)} ids ({cut} shared), "
            f"{len(sampled)} sampled over {trajectory.num_turns} turns, max |logprob diff| {diff:.2e}"
        )
        assert diff <= 1e-4


def test_decoding_the_ids_gives_back_the_messages(smollm2, env, trajectories):
    tokenizer = smollm2.tokenizer
    for trajectory in trajectories:
        replies = [m["content"] for m in trajectory.messages if m["role"] == "assistant"]
        spans = _sampled_spans(trajectory.loss_mask)
        assert len(spans) == len(replies) >= 1
        for (start, end), reply in zip(spans, replies):
            ids = trajectory.token_ids[start:end]
            if ids[-1] in tokenizer.eos_token_ids:  # the end-of-turn token is kept in the ids, not in the text
                ids = ids[:-1]
            assert tokenizer.decode(ids) == reply
        # The whole: the rendering of the conversation through its last assistant turn (observations
        # after it were never fed to the model); a turn cut at max_tokens lacks only the end-of-turn tag.
        last = max(i for i, m in enumerate(trajectory.messages) if m["role"] == "assistant")
        rendered = tokenizer.render_chat(
            trajectory.messages[: last + 1], tools=env.episode(trajectory.spec.task).tools, add_generation_prompt=False
        )
        decoded = tokenizer.decode(trajectory.token_ids)
        assert rendered.startswith(decoded)
        assert rendered[len(decoded) :] in ("\n", "<|im_end|>\n"), rendered[len(decoded) :][:200]


def test_a_turn_cut_at_max_tokens_is_closed_before_the_next_messages(smollm2):
    """The continuation after a cut turn starts with the end-of-turn token its sampled ids lack."""
    from trace_jax.agent.chat_codec import ChatCodec

    codec = ChatCodec(smollm2.tokenizer)
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am cut"}]
    new = [{"role": "user", "content": "Go on"}]
    closed = codec.continuation(history, new)
    cut = codec.continuation(history, new, closed=False)
    assert cut == smollm2.tokenizer.encode("<|im_end|>") + closed
    full = smollm2.tokenizer.apply_chat(history + new)
    assert full[-len(cut) :] == cut  # the first prompt + sampled ids + cut continuation = a full rendering
