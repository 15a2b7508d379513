"""GEPA, the prompt-optimisation baseline of TRACE's comparison, through the `gepa` package.

Per capability, GEPA evolves one guidance text appended to the base agent's system prompt: it scores
a candidate by playing the capability's environment with it (each episode one metric call, counted
here as it is played), and proposes the next candidate by showing a reflection LM the scored
episodes (compacted as the analyst sees them, with the evaluator's diagnostics as feedback). The
reflection LM is any OpenAI-compatible endpoint (`trace_jax.llm.ChatClient`) or the base model
itself, as the authors ran it. The texts found for the capabilities are then joined into the agent's
prompt for the target (`joined_guidance`, played through `env.guidance`), as the authors did: `gepa_arm`
runs the whole arm.
Resumable: GEPA saves its state in `<workdir>/gepa` after each iteration, and every evaluation played is
logged (`<workdir>/evaluations.jsonl`), so a rerun plays no evaluation twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import time
from collections.abc import Callable

import gepa
import jax
import ml_collections
from absl import logging

from trace_jax import distributed
from trace_jax.agent.episodes import recorded_episodes
from trace_jax.agent.rollout import MODEL, EpisodeSpec, RolloutConfig, RolloutEngine
from trace_jax.envs import make_environment
from trace_jax.envs.base import Environment, TaskSpec
from trace_jax.envs.guided import GuidedEnvironment
from trace_jax.evaluation import evaluate
from trace_jax.files import append_jsonl, write_json_atomic, write_jsonl_atomic
from trace_jax.llm import ChatClient, LlmSettings
from trace_jax.models.model import Model, load_model
from trace_jax.sampling import Sampler
from trace_jax.settings import non_negative_number, positive_int, setting
from trace_jax.trace.trajectories import compact, failure_reasons, from_record

COMPONENT = "guidance"  # the one text GEPA evolves per capability
REFLECTIONS = ("local", "llm")


@dataclasses.dataclass(frozen=True)
class GepaSettings:
    """The `gepa` block, per capability (the authors: 200 train seeds, 5,000 metric calls)."""

    # the capability environment's first train tasks: GEPA's reflection minibatches
    train_tasks: int = setting(16, "a positive int", positive_int)
    val_tasks: int = setting(8, "a positive int", positive_int)  # the train tasks after those: its Pareto front
    max_metric_calls: int = setting(256, "a positive int (episodes)", positive_int)  # episodes GEPA may play
    minibatch_size: int = setting(3, "a positive int", positive_int)
    # "local": the base model reflects; "llm": the config's `llm` endpoint
    reflection: str = setting("local", f"one of {', '.join(REFLECTIONS)}", lambda v: v in REFLECTIONS)
    reflection_max_tokens: int = setting(384, "a positive int", positive_int)  # the local reflection's reply
    reflection_temperature: float = setting(0.7, "a number >= 0", non_negative_number)
    # messages are cut to this many characters in what the reflection LM reads
    message_chars: int = setting(300, "a positive int", positive_int)
    # its episodes' sampling (greedy: the target's held-out evaluation is)
    temperature: float = setting(0.0, "a number >= 0 (0 is greedy)", non_negative_number)


class EpisodeAdapter:
    """GEPA's adapter: a data instance is a task, a candidate's score on it the reward of one episode played
    with the candidate's guidance. `make_engine(env)` builds the rollout engine for a guided environment.

    Every evaluation played is appended to `log_path` under a key drawn from the candidate's text and the
    tasks, which also seeds its episodes; an evaluation asked for again (GEPA scores its seed again when it
    resumes) is answered from the log, so a resumed run plays what the uninterrupted one played, once.
    `played` counts the episodes played, those of killed runs included."""

    propose_new_texts = None  # GEPA's own reflective proposal, with the reflection LM

    def __init__(
        self,
        env: Environment,
        make_engine: Callable[[Environment], RolloutEngine],
        *,
        seed: int,
        log_path: pathlib.Path,
        message_chars: int = 300,
    ):
        self.env, self.make_engine, self.seed = env, make_engine, seed
        self.log_path, self.message_chars = log_path, message_chars
        logged = recorded_episodes(log_path)  # up to a line cut by a kill, which is dropped
        write_jsonl_atomic(log_path, logged)
        self.memo = {entry["key"]: entry["records"] for entry in logged}
        self.played = sum(len(entry["records"]) for entry in logged)

    def evaluate(self, batch: list[TaskSpec], candidate: dict[str, str], capture_traces: bool = False):
        key = _digest([candidate[COMPONENT], [t.task_id for t in batch]])
        records = self.memo.get(key)
        if records is None:
            engine = self.make_engine(GuidedEnvironment(self.env, candidate[COMPONENT]))
            records = [
                t.record()
                for t in engine.run(
                    [EpisodeSpec(task) for task in batch], key=jax.random.fold_in(jax.random.key(self.seed), key)
                )
            ]
            append_jsonl(self.log_path, {"key": key, "records": records})
            self.memo[key] = records
            self.played += len(records)
        views = [self._view(task, record) for task, record in zip(batch, records)] if capture_traces else None
        return gepa.EvaluationBatch(outputs=records, scores=[r["reward"] for r in records], trajectories=views)

    def make_reflective_dataset(self, candidate: dict[str, str], eval_batch, components_to_update: list[str]):
        examples = [
            {"Inputs": view["ticket"], "Generated Outputs": view["messages"], "Feedback": view["feedback"]}
            for view in eval_batch.trajectories
        ]
        return {component: examples for component in components_to_update}

    def _view(self, task: TaskSpec, record: dict) -> dict:
        """What the reflection LM reads of an episode: the ticket, the compacted turns, and the feedback."""
        episode = self.env.episode(task)
        scored = from_record(record, episode.gold(), episode.tools)
        view = compact(scored, self.message_chars)
        turns = [
            f"{m['role']}: {m.get('tool_calls') or m.get('content', '')}"
            for m in view["messages"]
            if m.get("content") != scored.ticket
        ]
        reasons = failure_reasons(scored)
        feedback = f"reward {scored.reward:.2f} of 1.00" + (": " + "; ".join(reasons) if reasons else ": solved")
        return {"ticket": scored.ticket, "messages": "\n".join(turns), "feedback": feedback}


class _AbslLogger:
    """GEPA's log lines (one per iteration: the candidate chosen, the reflection's outcome) through absl."""

    def log(self, message: str) -> None:
        logging.info("GEPA: %s", message)


def _messages(prompt: str | list[dict]) -> list[dict]:
    """GEPA's reflection prompt (a text, or chat messages where it shows images) as chat messages."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def endpoint_reflection(client: ChatClient) -> Callable[[str | list[dict]], str]:
    """An OpenAI-compatible endpoint as GEPA's reflection LM (the client caches each reply on disk, so a resumed
    run asks nothing twice)."""
    return lambda prompt: client.complete(_messages(prompt))


class LocalReflectionLM:
    """The base model as GEPA's reflection LM: a prompt answered by the model's chat template and sampler. The
    sampling key is drawn from the prompt, so a prompt asked again (a resumed run) gets the same reply, as the
    endpoint's cache gives. A prompt longer than the context keeps its head and its tail (GEPA's instructions
    are at both ends)."""

    def __init__(self, model: Model, sampler: Sampler, *, max_new_tokens: int, temperature: float, seed: int):
        self.model, self.sampler = model, sampler
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.key = jax.random.key(seed)

    def __call__(self, prompt: str | list[dict]) -> str:
        messages = _messages(prompt)
        ids = self.model.tokenizer.apply_chat(messages, add_generation_prompt=True)
        room = self.sampler.max_context - self.max_new_tokens
        if len(ids) > room:
            logging.info("reflection prompt of %d tokens cut to %d (head and tail kept)", len(ids), room)
            ids = keep_ends(ids, room)
        key = jax.random.fold_in(self.key, _digest(messages))
        completion = self.sampler.generate(
            [ids],
            key=key,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            stop_token_ids=self.model.tokenizer.eos_token_ids,
        )[0][0]
        # The reply without the end-of-turn token it stopped on: in a proposed guidance that token would end
        # the system prompt's turn early.
        return self.model.tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def _digest(value) -> int:
    """A 28-bit number drawn from `value`'s JSON: a key that the same content always gets."""
    return int(hashlib.sha256(json.dumps(value, ensure_ascii=False).encode()).hexdigest()[:7], 16)


def keep_ends(ids: list[int], room: int) -> list[int]:
    """`ids` cut to `room` tokens by dropping the middle: the first half of the room from the head, the rest from
    the tail."""
    return ids if len(ids) <= room else ids[: room // 2] + ids[len(ids) - (room - room // 2) :]


def optimize_guidance(
    env: Environment,
    seed_text: str,
    make_engine: Callable[[Environment], RolloutEngine],
    reflection_lm: Callable[[str], str],
    settings: GepaSettings,
    workdir: str | pathlib.Path,
    *,
    seed: int = 0,
    split: str = "train",
) -> dict:
    """Runs GEPA on one capability's environment from `seed_text` into `workdir` (resumed when it holds a
    run); returns (and writes to result.json) the best text by validation score, every candidate with its
    validation score and the metric calls spent when it was found, and the episodes played."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tasks = env.tasks(split, settings.train_tasks + settings.val_tasks)
    adapter = EpisodeAdapter(
        env, make_engine, seed=seed, log_path=workdir / "evaluations.jsonl", message_chars=settings.message_chars
    )
    start = time.monotonic()
    result = gepa.optimize(
        seed_candidate={COMPONENT: seed_text},
        trainset=tasks[: settings.train_tasks],
        valset=tasks[settings.train_tasks :],
        adapter=adapter,
        reflection_lm=reflection_lm,
        reflection_minibatch_size=settings.minibatch_size,
        max_metric_calls=settings.max_metric_calls,
        run_dir=str(workdir / "gepa"),
        seed=seed,
        logger=_AbslLogger(),
        display_progress_bar=False,
        raise_on_exception=True,
    )
    candidates = [
        {"text": c[COMPONENT], "val_score": round(float(s), 6), "found_at_metric_calls": int(n)}
        for c, s, n in zip(result.candidates, result.val_aggregate_scores, result.discovery_eval_counts)
    ]
    summary = {
        "seed_text": seed_text,
        "best_text": result.best_candidate[COMPONENT],
        "best_val_score": round(float(result.val_aggregate_scores[result.best_idx]), 6),
        "seed_val_score": candidates[0]["val_score"],
        "metric_calls": int(result.total_metric_calls),
        "budget": settings.max_metric_calls,
        "episodes_played": adapter.played,
        "candidates": candidates,
        "seconds": round(time.monotonic() - start, 1),
    }
    write_json_atomic(workdir / "result.json", summary)
    logging.info(
        "GEPA: %d candidates, validation %.3f -> %.3f, %d metric calls (%d episodes played)",
        len(candidates),
        summary["seed_val_score"],
        summary["best_val_score"],
        summary["metric_calls"],
        adapter.played,
    )
    return summary


def best_within(summary: dict, metric_calls: int) -> str:
    """The best validation candidate GEPA had found by `metric_calls` metric calls (the scaling curve's
    points reuse one run: a candidate found later was not available at that budget)."""
    found = [c for c in summary["candidates"] if c["found_at_metric_calls"] <= metric_calls]
    return max(found, key=lambda c: c["val_score"])["text"]


def joined_guidance(texts: dict[str, str]) -> str:
    """The capabilities' optimised texts as one guidance for the target's system prompt, in the given order."""
    return "\n\n".join(
        f"{name.replace('_', ' ').capitalize()}: {text.strip()}" for name, text in texts.items() if text.strip()
    )


def guided_evaluation(heldout: ml_collections.ConfigDict, texts: dict[str, str]) -> ml_collections.ConfigDict:
    """The evaluation job's config `heldout` with the capabilities' texts joined into the agent's system prompt."""
    evaluation = ml_collections.ConfigDict(heldout.to_dict())
    evaluation.env.guidance = joined_guidance(texts)
    return evaluation


def gepa_arm(
    capabilities: dict[str, tuple[dict, str]],
    heldout: ml_collections.ConfigDict,
    rollout: RolloutConfig,
    settings: GepaSettings,
    llm: LlmSettings | None,
    budget: int,
    workdir: str | pathlib.Path,
) -> dict:
    """GEPA as one arm of the comparison: per capability (name -> (its environment's config, the text GEPA starts
    from, e.g. its description)), GEPA with an equal share of `budget` metric calls, the base model of `heldout`
    playing `rollout`'s episodes; then the texts joined into the system prompt of `heldout` (an evaluation job's
    config) and evaluated. In a run of several processes GEPA's loop runs once, on process 0, and every process
    plays its share of the evaluation. Every part resumes from `workdir`; returns (and writes to result.json) the
    texts, the budget spent, the held-out summary and this call's wall time."""
    workdir = pathlib.Path(workdir)
    start = time.monotonic()
    runs = distributed.on_main(lambda: _optimize_each(capabilities, heldout, rollout, settings, llm, budget, workdir))
    texts = {name: run["best_text"] for name, run in runs.items()}
    evaluation = guided_evaluation(heldout, texts)
    summary = evaluate(evaluation, workdir / "heldout")
    result = {
        "texts": texts,
        "guidance": evaluation.env.guidance,
        "budget": budget,
        "metric_calls": sum(run["metric_calls"] for run in runs.values()),
        "episodes_played": sum(run["episodes_played"] for run in runs.values()),
        "capabilities": runs,
        "heldout": summary,
        "seconds": round(time.monotonic() - start, 1),
    }
    distributed.on_main(lambda: write_json_atomic(workdir / "result.json", result))  # the scaling curve reads it
    return result


def _optimize_each(
    capabilities: dict[str, tuple[dict, str]],
    heldout: ml_collections.ConfigDict,
    rollout: RolloutConfig,
    settings: GepaSettings,
    llm: LlmSettings | None,
    budget: int,
    workdir: pathlib.Path,
) -> dict[str, dict]:
    """`optimize_guidance` on each capability's environment with an equal share of `budget`; name -> its result."""
    model = load_model(heldout.model, heldout.dtype)
    sampler = Sampler(model.cfg, model.params, detokenize=model.tokenizer.decode)
    if settings.reflection == "llm":
        reflection_lm = endpoint_reflection(ChatClient(llm, workdir / "llm_cache"))
    else:
        reflection_lm = LocalReflectionLM(
            model,
            sampler,
            max_new_tokens=settings.reflection_max_tokens,
            temperature=settings.reflection_temperature,
            seed=heldout.seed,
        )

    def make_engine(env: Environment) -> RolloutEngine:
        return RolloutEngine(env, agent=MODEL, user=MODEL, sampler=sampler, tokenizer=model.tokenizer, config=rollout)

    share = dataclasses.replace(settings, max_metric_calls=max(budget // len(capabilities), 1))
    return {
        name: optimize_guidance(
            make_environment(ml_collections.ConfigDict(env)),
            seed_text,
            make_engine,
            reflection_lm,
            share,
            workdir / name,
            seed=heldout.seed,
        )
        for name, (env, seed_text) in capabilities.items()
    }
