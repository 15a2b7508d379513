"""Batched multi-turn rollouts, token in / token out: many episodes advance together through one sampler.

Each live episode has an agent and, for tasks with a user, a user simulator. A speaker is
either the model (a row of the sampler's KV cache: the agent with its adapter, the user
with no adapter) or a scripted actor (`trace_jax.agent.scripted`). Every round, all model
speakers whose turn it is generate together in one sampler call; an episode that ends
frees its rows for the next queued one.

The agent's record is exactly what the model saw: its token ids (first prompt, then each
sampled turn as sampled, then the encoded observations), a loss mask (1 on sampled
tokens), the sampler's logprobs, and its messages with assistant turns as raw text.
A scripted agent (the gold agent) is recorded the same way when the engine has a tokenizer:
each of its turns as the tokens the model would emit for that text, on the loss mask, so its
trajectories are behaviour-cloning data that match what the model samples later.
Model output never crashes the engine: malformed tool calls become error observations,
and max turns, max tokens per turn, too many errors and a full context end the episode
with a recorded reason. A user simulator's turn cut at max tokens is passed on as written
(its end-of-turn token added to the user's tokens); only the agent's is a failure.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from trace_jax import lora
from trace_jax.agent.chat_codec import ChatCodec
from trace_jax.agent.tool_calls import parse_assistant_output
from trace_jax.envs import base
from trace_jax.models.tokenizer import ChatTokenizer
from trace_jax.sampling import FINISH_CONTEXT, FINISH_LENGTH, Sampler, common_prefix_length

MODEL = "model"  # the speaker value meaning "sample this speaker with the model"


class Scripted(Protocol):
    """A speaker that writes its turns without the model (see `trace_jax.agent.scripted`)."""

    def reply(self, episode: base.Episode) -> str: ...

    def forget(self, episode: base.Episode) -> None: ...


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Limits and sampling settings of a rollout."""

    batch_size: int = 16  # sampler rows (an episode with a model user takes two); also caps live episodes
    max_turns: int = 30  # agent turns per episode
    max_tokens_per_turn: int = 512
    max_errors: int = 10  # error observations (malformed calls, failed tools) per episode
    temperature: float = 1.0
    top_p: float = 1.0
    user_temperature: float = 0.0


@dataclasses.dataclass(frozen=True)
class Job:
    """One episode to play: a task, its trial number (for pass^k) and the agent's adapter."""

    task: base.TaskSpec
    trial: int = 0
    adapter_idx: int = lora.NO_ADAPTER


@dataclasses.dataclass
class Trajectory:
    """A finished episode, as the agent saw it, and its score."""

    job: Job
    messages: list[base.Message]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    end_reason: str
    outcome: base.Outcome
    num_turns: int
    num_errors: int
    generated_tokens: int
    user_messages: list[base.Message] | None = None  # the user simulator's side (None: solo task)

    def record(self) -> dict[str, Any]:
        """A JSON-ready summary for episode logs (messages and outcome; no token arrays)."""
        return {"task_id": self.job.task.task_id, "family": self.job.task.family, "split": self.job.task.split,
                "trial": self.job.trial, "adapter_idx": self.job.adapter_idx, "end_reason": self.end_reason,
                "reward": self.outcome.reward, "success": self.outcome.success,
                "components": self.outcome.components, "info": self.outcome.info, "num_turns": self.num_turns,
                "num_errors": self.num_errors, "generated_tokens": self.generated_tokens,
                "messages": self.messages}


@dataclasses.dataclass
class _Speaker:
    """One side of a conversation: its messages and, when the model speaks it, its cache row and tokens."""

    codec: ChatCodec | None
    messages: list[base.Message]
    row: int | None = None
    encoded: int = 0  # messages already in token_ids
    token_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)

    def pending_tokens(self) -> list[int]:
        """Tokens to feed before this speaker's next turn: its messages not yet encoded."""
        if not self.token_ids:
            return self.codec.first_prompt(self.messages)
        closed = self.token_ids[-1] in self.codec.tokenizer.eos_token_ids  # a user turn may be cut at max tokens
        return self.codec.continuation(self.messages[: self.encoded], self.messages[self.encoded :], closed)


@dataclasses.dataclass
class _Live:
    """An episode under way."""

    index: int
    job: Job
    episode: base.Episode
    agent: _Speaker
    user: _Speaker | None
    next_speaker: str  # "agent" or "user"
    turns: int = 0
    errors: int = 0
    generated: int = 0
    end_reason: str | None = None


class RolloutEngine:
    """Plays jobs in an environment with a model and/or scripted speakers."""

    def __init__(self, env: base.Environment, *, agent: str | Scripted = MODEL, user: str | Scripted = MODEL,
                 sampler: Sampler | None = None, tokenizer: ChatTokenizer | None = None,
                 config: RolloutConfig = RolloutConfig()):
        uses_model = agent == MODEL or user == MODEL
        if uses_model and (sampler is None or tokenizer is None):
            raise ValueError("a model speaker needs sampler= and tokenizer=")
        self.env, self.agent, self.user = env, agent, user
        self.sampler, self.tokenizer, self.config = sampler, tokenizer, config
        self._uses_model = uses_model
        self._rows_per_episode = (agent == MODEL) + (user == MODEL)  # at most; solo tasks use no user row
        self._prefixes: dict[tuple[int, bool], tuple[list[int], int]] = {}  # (tokens, cache slot): see _start_row

    def run(self, jobs: Sequence[Job], *, key: jax.Array,
            on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Plays every job; returns trajectories in job order. `on_done` sees each as it ends."""
        queue = deque(enumerate(jobs))
        results: list[Trajectory | None] = [None] * len(jobs)
        live: list[_Live] = []
        free_rows = list(range(self.config.batch_size)) if self._uses_model else []
        cache = self.sampler.new_cache(self.config.batch_size) if self._uses_model else None
        self._prefixes = {}  # per run: the adapters may change between runs
        round_index = 0
        while queue or live:
            while queue and len(live) < self.config.batch_size and len(free_rows) >= self._rows_per_episode:
                index, job = queue.popleft()
                live.append(self._start(index, job, free_rows))
            if not live:
                raise ValueError(f"batch_size {self.config.batch_size} is too small for one episode")
            cache = self._play_round(live, cache, jax.random.fold_in(key, round_index))
            round_index += 1
            for item in [item for item in live if item.end_reason is not None]:
                live.remove(item)
                results[item.index] = self._finish(item, free_rows)
                if on_done is not None:
                    on_done(results[item.index])
        return results

    def _start(self, index: int, job: Job, free_rows: list[int]) -> _Live:
        episode = self.env.episode(job.task)
        messages = episode.reset()
        tools = episode.tools
        agent = _Speaker(ChatCodec(self.tokenizer, tools) if self.tokenizer is not None else None, list(messages))
        if self.agent == MODEL:
            agent.row = free_rows.pop()
        user_messages = episode.user_simulator_messages()
        user = None
        if user_messages is not None:
            codec = ChatCodec(self.tokenizer, episode.user_tools or None) if self.user == MODEL else None
            user = _Speaker(codec, list(user_messages))
            if self.user == MODEL:
                user.row = free_rows.pop()
        first = "user" if messages[-1]["role"] == "assistant" else "agent"
        return _Live(index, job, episode, agent, user, next_speaker=first)

    def _play_round(self, live: list[_Live], cache, key):
        """One turn of every live episode: scripted speakers now, model speakers in one sampler call."""
        model_turns, texts = [], {}
        for item in live:
            if item.next_speaker == "agent" and item.turns >= self.config.max_turns:
                item.end_reason = base.END_MAX_TURNS
                continue
            speaker = self._speaker(item)
            actor = self.agent if item.next_speaker == "agent" else self.user
            if actor != MODEL:
                text = actor.reply(item.episode)
                if speaker.codec is not None:
                    self._record_scripted_turn(item, speaker, text)
                texts[id(item)] = (text, None)
                continue
            pending = speaker.pending_tokens()
            room = self.sampler.max_context - len(speaker.token_ids) - len(pending)
            if room < 1:
                item.end_reason = base.END_CONTEXT
                continue
            model_turns.append((item, speaker, pending, min(room, self.config.max_tokens_per_turn)))
        if model_turns:
            cache, outputs = self._generate(cache, model_turns, key)
            texts.update(outputs)
        for item in live:
            if id(item) in texts:
                text, finish = texts[id(item)]
                self._take_turn(item, text, finish)
        return cache

    def _speaker(self, item: _Live) -> _Speaker:
        if item.next_speaker == "agent":
            return item.agent
        if item.user is None:
            raise ValueError(f"episode {item.job.task.task_id} awaits a user but has no user simulator")
        return item.user

    def _generate(self, cache, turns, key):
        """Samples the next turn of every (item, speaker) in `turns` together; records their tokens."""
        rows = [speaker.row for _, speaker, _, _ in turns]
        is_agent = [speaker is item.agent for item, speaker, _, _ in turns]
        adapters = [item.job.adapter_idx if a else lora.NO_ADAPTER for (item, *_), a in zip(turns, is_agent)]
        feeds = []
        for (_, speaker, pending, _), agent, adapter in zip(turns, is_agent, adapters):
            skip = 0
            if not speaker.token_ids:  # a row starting a new conversation
                cache, skip = self._start_row(cache, speaker.row, pending, (adapter, agent))
            feeds.append(pending[skip:])
        completions, cache = self.sampler.generate(
            feeds, key=key, cache=cache, rows=rows,
            max_new_tokens=[budget for *_, budget in turns],
            temperature=[self.config.temperature if a else self.config.user_temperature for a in is_agent],
            top_p=[self.config.top_p if a else 1.0 for a in is_agent],
            adapter_idx=adapters,
            stop_token_ids=sorted(self.tokenizer.eos_token_ids))
        outputs = {}
        for (item, speaker, pending, _), completion in zip(turns, completions):
            ids = completion.token_ids
            speaker.token_ids += pending + ids
            speaker.loss_mask += [0] * len(pending) + [1] * len(ids)
            speaker.logprobs += [0.0] * len(pending) + list(completion.logprobs)
            item.generated += len(ids) if speaker is item.agent else 0
            ended = bool(ids) and ids[-1] in self.tokenizer.eos_token_ids
            outputs[id(item)] = (self.tokenizer.decode(ids[:-1] if ended else ids), completion.finish_reason)
        return cache, outputs

    def _record_scripted_turn(self, item: _Live, speaker: _Speaker, text: str) -> None:
        """Records a scripted agent's turn as the tokens the model would emit for it (its text, then
        the end-of-turn token), on the loss mask: trajectories to clone (SFT) that are token for
        token what sampling the same turns would give."""
        pending = speaker.pending_tokens()
        ids = speaker.codec.assistant_turn(text)
        speaker.token_ids += pending + ids
        speaker.loss_mask += [0] * len(pending) + [1] * len(ids)
        speaker.logprobs += [0.0] * (len(pending) + len(ids))
        item.generated += len(ids)

    def _start_row(self, cache, row: int, prompt: list[int], prefix_key: tuple[int, bool]):
        """Empties `row` for a new conversation, or starts it from the stored prefix it shares
        with earlier first prompts of the same speaker and adapter (system prompts repeat, so
        each is prefilled once per run). Returns the cache and how many prompt tokens it holds."""
        minimum = self.sampler.min_shared_prefix
        if minimum is None or len(prompt) <= minimum:
            return self.sampler.start_row(cache, row), 0
        if prefix_key not in self._prefixes:
            tokens = prompt[:-1]  # the row must feed at least its last prompt token
            cache, slot = self.sampler.add_prefix(cache, tokens, prefix_key[0])
            self._prefixes[prefix_key] = (tokens, slot)
        tokens, slot = self._prefixes[prefix_key]
        shared = min(common_prefix_length([tokens, prompt]), len(prompt) - 1)
        if shared < minimum:
            return self.sampler.start_row(cache, row), 0
        return self.sampler.start_row(cache, row, slot, shared), shared

    def _take_turn(self, item: _Live, text: str, finish: str | None) -> None:
        """Applies one speaker's turn to the episode and routes what comes back."""
        speaker = self._speaker(item)
        speaker.messages.append({"role": "assistant", "content": text})
        speaker.encoded = len(speaker.messages)
        if finish == FINISH_CONTEXT:
            item.end_reason = base.END_CONTEXT
        elif finish == FINISH_LENGTH and item.next_speaker == "agent":  # the agent's failure
            item.end_reason = base.END_TURN_TOO_LONG
        elif item.next_speaker == "agent":
            self._agent_turn(item, text)
        else:
            self._route(item, item.episode.user_turn(text))

    def _agent_turn(self, item: _Live, text: str) -> None:
        item.turns += 1
        parsed = parse_assistant_output(text, item.episode.tools)
        if parsed.tool_calls or parsed.errors:
            calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in parsed.tool_calls]
            result = (item.episode.step({"role": "assistant", "content": parsed.content, "tool_calls": calls})
                      if calls else base.StepResult())
            errors = tuple({"role": "tool", "name": "error", "content": error} for error in parsed.errors)  # "Error: ..."
            result = dataclasses.replace(result, observations=result.observations + errors)
        else:
            result = item.episode.step({"role": "assistant", "content": text})
        item.errors += sum(str(o.get("content", "")).startswith("Error") for o in result.observations
                           if o["role"] == "tool")
        self._route(item, result)
        if item.end_reason is None and item.errors > self.config.max_errors:
            item.end_reason = base.END_MAX_ERRORS

    def _route(self, item: _Live, result: base.StepResult) -> None:
        """Gives the observations to the agent, or the agent's words (or the results of the user's own
        tool calls) to the user, or ends the episode."""
        if result.done:
            item.end_reason = result.end_reason
            return
        if result.awaiting_user:
            if item.user is None:
                raise ValueError(f"episode {item.job.task.task_id} awaits a user but has no user simulator")
            if item.next_speaker == "user":  # the user ran tools (dual control): it sees their results
                item.user.messages.extend(result.observations)
            else:
                item.user.messages.append({"role": "user", "content": item.agent.messages[-1]["content"]})
            item.next_speaker = "user"
            return
        item.agent.messages.extend(result.observations)
        item.next_speaker = "agent"

    def _finish(self, item: _Live, free_rows: list[int]) -> Trajectory:
        if item.end_reason not in base.NORMAL_ENDS:
            item.episode.end(item.end_reason)
        outcome = item.episode.evaluate()
        for actor in (self.agent, self.user):
            if actor != MODEL:
                actor.forget(item.episode)
        free_rows.extend(s.row for s in (item.agent, item.user) if s is not None and s.row is not None)
        agent = item.agent
        return Trajectory(item.job, agent.messages, agent.token_ids, agent.loss_mask, agent.logprobs,
                          item.end_reason, outcome, item.turns, item.errors, item.generated,
                          None if item.user is None else item.user.messages)
