"""Batched multi-turn rollouts, token in / token out: many episodes advance together through one sampler.

Each live episode has an agent and, for tasks with a user, a user simulator. A speaker is
either the model (a row of the sampler's KV cache: the agent with its adapter, the user
with no adapter) or a scripted actor (`trace_jax.envs.scripted`). Model rows sample
together in one `sampling.Session`, each at its own pace: a row whose turn ends is given
the episode's next turn (tool results, the user's reply) while the others go on, and an
episode that ends frees its rows for the next queued one.

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

An episode may open the agent's first turn for it (its `opening` text: the capability environments'
"opened_call" and "written_call" scaffolds write in the next call's tool name, or the whole call). Those
tokens are fed, then recorded as the agent's own (on the loss mask, sampler logprob 0: the scaffold chose
them with certainty), and the turn's text is the opening and what the agent sampled after it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from trace_jax import lora, runtime
from trace_jax.agent.chat_codec import ChatCodec
from trace_jax.envs import base
from trace_jax.models.tokenizer import ChatTokenizer
from trace_jax.sampling import FINISH_CONTEXT, FINISH_LENGTH, POLICIES, Completion, Sampler, Session
from trace_jax.settings import non_negative_int, non_negative_number, none_or, number, positive_int, setting
from trace_jax.tool_calls import parse_assistant_output

MODEL = "model"  # the speaker value meaning "sample this speaker with the model"


class Scripted(Protocol):
    """A speaker that writes its turns without the model (see `trace_jax.envs.scripted`)."""

    def reply(self, episode: base.Episode) -> str: ...

    def forget(self, episode: base.Episode) -> None: ...


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Limits and sampling settings of a rollout (an evaluation's `rollout` block: `trace_jax.settings`)."""

    # sampler rows (an episode with a model user takes two; fewer when fewer episodes fill them: `session_rows`);
    # also caps live episodes
    batch_size: int = setting(16, "an int >= 2 (agent and user rows)", lambda v: positive_int(v) and v >= 2)
    max_turns: int = setting(30, "a positive int", positive_int)  # agent turns per episode
    max_tokens_per_turn: int = setting(512, "a positive int", positive_int)
    # error observations (malformed calls, failed tools) per episode
    max_errors: int = setting(10, "an int >= 0", non_negative_int)
    temperature: float = setting(1.0, ">= 0 (0 is greedy)", non_negative_number)
    top_p: float = setting(1.0, "in (0, 1]", lambda v: number(v) and 0 < v <= 1)
    user_temperature: float = setting(0.0, ">= 0", non_negative_number)
    # how the sampler schedules rows (`Sampler`'s policy): None picks by backend
    sampler_policy: str | None = setting(
        None, f"None or one of {POLICIES}", none_or(lambda v: v in POLICIES), optional=True
    )


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
    """One episode to play: a task, its trial number (for pass^k), the agent's adapter and whether the
    agent plays it with the task's hint in its system prompt (`env.episode(task, hint=True)`, which only
    environments offering hints take: `trace_jax.envs.hints.offers_hint`)."""

    task: base.TaskSpec
    trial: int = 0
    adapter_idx: int = lora.NO_ADAPTER
    hint: bool = False

    def stream(self, speaker: str) -> int:
        """The random stream `speaker`'s turns draw from (`sampling.row_keys`): one per task, trial and speaker,
        so the episode samples the same in any batch, order or process that plays it."""
        return zlib.crc32(f"{self.task.task_id}\x00{self.trial}\x00{speaker}".encode()) & 0x7FFFFFFF


@dataclasses.dataclass
class Trajectory:
    """A finished episode, as the agent saw it, and its score."""

    spec: EpisodeSpec
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
        return {
            "task_id": self.spec.task.task_id,
            "family": self.spec.task.family,
            "split": self.spec.task.split,
            "trial": self.spec.trial,
            "hint": self.spec.hint,
            "adapter_idx": self.spec.adapter_idx,
            "end_reason": self.end_reason,
            "reward": self.outcome.reward,
            "success": self.outcome.success,
            "components": self.outcome.components,
            "info": self.outcome.info,
            "num_turns": self.num_turns,
            "num_errors": self.num_errors,
            "generated_tokens": self.generated_tokens,
            "messages": self.messages,
        }


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
    spec: EpisodeSpec
    episode: base.Episode
    agent: _Speaker
    user: _Speaker | None
    next_speaker: str  # "agent" or "user"
    turns: int = 0
    errors: int = 0
    generated: int = 0
    end_reason: str | None = None
    opened: list[int] = dataclasses.field(default_factory=list)  # the opening of the agent turn being sampled


class RolloutEngine:
    """Plays episodes (`EpisodeSpec`s) in an environment with a model and/or scripted speakers."""

    def __init__(
        self,
        env: base.Environment,
        *,
        agent: str | Scripted = MODEL,
        user: str | Scripted = MODEL,
        sampler: Sampler | None = None,
        tokenizer: ChatTokenizer | None = None,
        config: RolloutConfig = RolloutConfig(),
    ):
        uses_model = agent == MODEL or user == MODEL
        if uses_model and (sampler is None or tokenizer is None):
            raise ValueError("a model speaker needs sampler= and tokenizer=")
        self.env, self.agent, self.user = env, agent, user
        self.sampler, self.tokenizer, self.config = sampler, tokenizer, config
        self._uses_model = uses_model
        self._rows_per_episode = (agent == MODEL) + (user == MODEL)  # at most; solo tasks use no user row
        self.stats: collections.Counter = collections.Counter()  # the last run's: see `Session.stats`, and run_s

    def run(
        self, specs: Sequence[EpisodeSpec], *, key: jax.Array, on_done: Callable[[Trajectory], None] | None = None
    ) -> list[Trajectory]:
        """Plays the episode of every spec; returns trajectories in the specs' order. `on_done` sees each as it ends.

        Episodes advance independently: when a model turn ends, the episode takes it (tool calls,
        the user's reply) and its row is fed the next turn while the other rows go on sampling,
        and an episode that ends frees its rows for the next queued episode at once. Each speaker of an
        episode samples from its own stream of `key` (`EpisodeSpec.stream`), so an episode plays the same alone, in
        any batch or order, or in another process's share of the episodes (numerics allowing).
        """
        queue = collections.deque(enumerate(specs))
        results: list[Trajectory | None] = [None] * len(specs)
        live: list[_Live] = []
        free_rows = list(reversed(range(self.config.batch_size))) if self._uses_model else []  # lowest first
        session: Session | None = None
        sampling: dict[int, _Live] = {}  # row -> the episode whose model turn it samples
        start = time.perf_counter()
        upkeep = runtime.Upkeep()  # a long run meets many shapes: memory maps, a fragmented heap
        while queue or live:
            upkeep()
            while queue and len(live) < self.config.batch_size and len(free_rows) >= self._rows_per_episode:
                index, spec = queue.popleft()
                live.append(self._start(index, spec, free_rows))
            if not live:
                raise ValueError(f"batch_size {self.config.batch_size} is too small for one episode")
            if session is None and self._uses_model:  # all rows unless every episode has started
                rows = session_rows(
                    self.config.batch_size - len(free_rows),
                    self.config.batch_size,
                    bool(queue) or self.sampler.fixed_shapes,
                )
                free_rows = [row for row in free_rows if row < rows]
                session = self.sampler.session(rows, stop_token_ids=self.tokenizer.eos_token_ids)
            busy = {id(item) for item in sampling.values()}
            turns = [turn for item in live if id(item) not in busy and (turn := self._advance(item))]
            if turns:
                self._feed(session, turns, sampling)
            if session is not None and session.running:
                for row, completion in session.step(key, return_early=True).items():
                    self._take_model_turn(sampling.pop(row), completion)
            ended = [item for item in live if item.end_reason is not None]
            for item in ended:
                live.remove(item)
                results[item.index] = self._finish(item)
                free_rows.extend(_rows(item))
                if on_done is not None:
                    on_done(results[item.index])
            if ended and session is not None:
                session.release([row for item in ended for row in _rows(item)])
        self.stats = collections.Counter(session.stats if session is not None else {})
        self.stats["run_s"] = time.perf_counter() - start
        return results

    def _start(self, index: int, spec: EpisodeSpec, free_rows: list[int]) -> _Live:
        episode = self.env.episode(spec.task, hint=True) if spec.hint else self.env.episode(spec.task)
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
        return _Live(index, spec, episode, agent, user, next_speaker=first)

    def _advance(self, item: _Live) -> tuple[_Live, _Speaker, list[int], int] | None:
        """Plays the episode's scripted turns until a model speaker is to speak; returns that turn
        (episode, speaker, tokens to feed, token budget), or None once the episode has ended."""
        while item.end_reason is None:
            if item.next_speaker == "agent" and item.turns >= self.config.max_turns:
                item.end_reason = base.END_MAX_TURNS
                break
            speaker = self._speaker(item)
            actor = self.agent if item.next_speaker == "agent" else self.user
            if actor != MODEL:
                text = actor.reply(item.episode)
                if speaker.codec is not None:
                    self._record_scripted_turn(item, speaker, text)
                self._take_turn(item, text, None)
                continue
            pending = speaker.pending_tokens()
            opening = getattr(item.episode, "opening", "") if speaker is item.agent and item.turns == 0 else ""
            item.opened = self.tokenizer.encode(opening) if opening else []
            room = self.sampler.max_context - len(speaker.token_ids) - len(pending) - len(item.opened)
            if room < 1:
                item.end_reason = base.END_CONTEXT
                break
            return item, speaker, pending, min(room, self.config.max_tokens_per_turn)
        return None

    def _speaker(self, item: _Live) -> _Speaker:
        if item.next_speaker == "agent":
            return item.agent
        if item.user is None:
            raise ValueError(f"episode {item.spec.task.task_id} awaits a user but has no user simulator")
        return item.user

    def _feed(self, session: Session, turns: list, sampling: dict[int, _Live]) -> None:
        """Starts sampling the next turn of every (episode, speaker) in `turns`, prefilled together.
        A row starting a conversation continues the stored prefix its first prompt shares with
        earlier first prompts of the same speaker and adapter (system prompts repeat)."""
        rows, feeds, adapters, agents, streams = [], [], [], [], []
        for item, speaker, pending, _ in turns:
            agent = speaker is item.agent
            adapter = item.spec.adapter_idx if agent else lora.NO_ADAPTER
            held = 0 if speaker.token_ids else session.start(speaker.row, pending, adapter, group=agent)
            opened = item.opened if agent else []
            speaker.token_ids += pending + opened
            speaker.loss_mask += [0] * len(pending) + [1] * len(opened)
            speaker.logprobs += [0.0] * (len(pending) + len(opened))
            rows.append(speaker.row)
            feeds.append(pending[held:] + opened)
            adapters.append(adapter)
            agents.append(agent)
            streams.append(item.spec.stream("agent" if agent else "user"))
            sampling[speaker.row] = item
        session.feed(
            rows,
            feeds,
            max_new_tokens=[budget for *_, budget in turns],
            temperature=[self.config.temperature if a else self.config.user_temperature for a in agents],
            top_p=[self.config.top_p if a else 1.0 for a in agents],
            adapter_idx=adapters,
            stream=streams,
        )

    def _take_model_turn(self, item: _Live, completion: Completion) -> None:
        """Records a sampled turn (its tokens on the loss mask, with their logprobs) and takes it, after the
        opening written in for it, if any."""
        speaker = self._speaker(item)
        ids = completion.token_ids
        speaker.token_ids += ids
        speaker.loss_mask += [1] * len(ids)
        speaker.logprobs += list(completion.logprobs)
        item.generated += len(ids) if speaker is item.agent else 0
        ended = bool(ids) and ids[-1] in self.tokenizer.eos_token_ids
        opened, item.opened = (item.opened if speaker is item.agent else []), []
        self._take_turn(item, self.tokenizer.decode(opened + (ids[:-1] if ended else ids)), completion.finish_reason)

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
            result = (
                item.episode.step({"role": "assistant", "content": parsed.content, "tool_calls": calls})
                if calls
                else base.StepResult()
            )
            errors = tuple(
                {"role": "tool", "name": "error", "content": error} for error in parsed.errors
            )  # "Error: ..."
            result = dataclasses.replace(result, observations=result.observations + errors)
        else:
            result = item.episode.step({"role": "assistant", "content": text})
        item.errors += sum(
            str(o.get("content", "")).startswith("Error") for o in result.observations if o["role"] == "tool"
        )
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
                raise ValueError(f"episode {item.spec.task.task_id} awaits a user but has no user simulator")
            if item.next_speaker == "user":  # the user ran tools (dual control): it sees their results
                item.user.messages.extend(result.observations)
            else:
                item.user.messages.append({"role": "user", "content": item.agent.messages[-1]["content"]})
            item.next_speaker = "user"
            return
        item.agent.messages.extend(result.observations)
        item.next_speaker = "agent"

    def _finish(self, item: _Live) -> Trajectory:
        if item.end_reason not in base.NORMAL_ENDS:
            item.episode.end(item.end_reason)
        outcome = item.episode.evaluate()
        for actor in (self.agent, self.user):
            if actor != MODEL:
                actor.forget(item.episode)
        agent = item.agent
        return Trajectory(
            item.spec,
            agent.messages,
            agent.token_ids,
            agent.loss_mask,
            agent.logprobs,
            item.end_reason,
            outcome,
            item.turns,
            item.errors,
            item.generated,
            None if item.user is None else item.user.messages,
        )


def session_rows(used: int, batch_size: int, all_rows: bool) -> int:
    """The sampler rows of a run whose first episodes use `used` rows: all of them with `all_rows` (more episodes
    to start, or a sampler whose programs are compiled for its rows); else a run whose episodes all start at once
    takes only what they use (a decode step's cost grows with its rows on a CPU), rounded up to a power of two
    so runs of similar size share compiled programs."""
    return batch_size if all_rows else min(batch_size, 1 << max(used - 1, 0).bit_length())


def rollout_profile(stats: collections.Counter) -> dict:
    """Where a run went (`RolloutEngine.stats`): decoding, prefilling (shared system prompts, tool results, user
    turns, new episodes; openings copied from rows holding them) and the host (tools, the evaluator, encoding
    turns), with the rows busy per decode step, the mean position of a prefilled token in its conversation, and,
    under the fused policy, the decode steps that fed rows in lanes and in full (`kernels.fused`)."""
    host = stats["run_s"] - stats["decode_s"] - stats["prefill_s"]
    return {
        "decode_s": round(stats["decode_s"], 1),
        "prefill_s": round(stats["prefill_s"], 1),
        "host_s": round(host, 1),
        "decode_steps": stats["decode_steps"],
        "decode_calls": stats["decode_calls"],
        "rows_per_decode_step": round(stats["decode_tokens"] / max(stats["decode_steps"], 1), 2),
        "s_per_decode_step": round(stats["decode_s"] / max(stats["decode_steps"], 1), 3),
        "prefix_prefills": stats["prefix_prefills"],
        "prefix_tokens": stats["prefix_tokens"],
        "prefill_calls": stats["prefill_calls"],
        "prefill_rows": stats["prefill_rows"],
        "prefill_tokens": stats["prefill_tokens"],
        "prefill_padded_tokens": stats["prefill_padded_tokens"],
        "prefill_position": round(
            stats["prefill_positions"] / max(stats["prefill_tokens"] + stats["prefix_tokens"], 1), 1
        ),
        "copied_rows": stats["copied_rows"],
        "copied_tokens": stats["copied_tokens"],
        "cache_resizes": stats["resizes"],
        "lane_feed_steps": stats["lane_feed_steps"],
        "full_feed_steps": stats["full_feed_steps"],
    }


def _rows(item: _Live) -> list[int]:
    """The sampler rows an episode's model speakers use."""
    return [s.row for s in (item.agent, item.user) if s is not None and s.row is not None]
