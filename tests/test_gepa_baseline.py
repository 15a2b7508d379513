"""The GEPA baseline: GEPA (the real `gepa` package) evolving the guidance in the agent's system prompt on a
capability environment, with a reflection LM behind a real OpenAI-compatible server on 127.0.0.1 (answering
from a script), its budget counted by the code that plays the episodes, resume, and the base model as the
reflection LM. (Guidance itself: tests/test_env_wrappers.py; the whole GEPA arm on the tiny model, in the
experiment job: tests/test_trace_pipeline.py.)

The agent of the GEPA run is scripted: it plays the gold calls when its guidance holds a key phrase and
does nothing otherwise, a stand-in for a model that follows its prompt, so that which candidate wins is known.
"""

import json

import pytest
import tau2  # noqa: F401 - a missing τ² fails the suite instead of skipping it
from scripted_llm_server import ScriptedLLMServer

from trace_jax.agent.rollout import RolloutConfig, RolloutEngine
from trace_jax.baselines import gepa as gepa_baseline
from trace_jax.envs.capability import CAPABILITIES, CapabilityEnvironment
from trace_jax.envs.scripted import GoldAgent, ScriptedUser
from trace_jax.llm import ChatClient, LlmSettings
from trace_jax.models.model import load_model
from trace_jax.sampling import Completion, Sampler
from trace_jax.settings import defaults, from_config

KEY_PHRASE = "Make every call the ticket needs"
HELPFUL = f"{KEY_PHRASE}, with the exact arguments, then state the outcome."


class FollowsGuidance:
    """Plays the task's gold turns when its guidance holds KEY_PHRASE, else ends at once with an empty reply."""

    def __init__(self):
        self.gold = GoldAgent()

    def reply(self, episode) -> str:
        return self.gold.reply(episode) if KEY_PHRASE in getattr(episode, "guidance", "") else ""

    def forget(self, episode) -> None:
        self.gold.forget(episode)


def _env() -> CapabilityEnvironment:
    return CapabilityEnvironment(CAPABILITIES["tool_calling"], policy=False)


def _client(server, cache_dir) -> ChatClient:
    return ChatClient(LlmSettings(model="scripted-reflection", base_url=server.base_url, max_retries=0), cache_dir)


def _optimize(workdir, server, played_guidance: list[str]) -> dict:
    cfg = gepa_baseline.GepaSettings(train_tasks=6, val_tasks=4, max_metric_calls=40, minibatch_size=2)

    def make_engine(env):
        played_guidance.append(env.guidance)
        return RolloutEngine(env, agent=FollowsGuidance(), user=ScriptedUser(), config=RolloutConfig(batch_size=4))

    reflect = gepa_baseline.endpoint_reflection(_client(server, workdir / "llm_cache"))
    return gepa_baseline.optimize_guidance(_env(), "Help the customer.", make_engine, reflect, cfg, workdir / "run")


def test_gepa_keeps_the_reflected_guidance_that_solves_the_tasks_counts_its_episodes_and_resumes(tmp_path):
    script = ["```\nBe kind to the customer.\n```", f"A better instruction:\n```\n{HELPFUL}\n```"]
    played: list[str] = []
    with ScriptedLLMServer(script + ["```\nBe brief.\n```"] * 20) as server:
        summary = _optimize(tmp_path, server, played)
        requests = list(server.requests)
    print(f"\n[gepa] {json.dumps({k: v for k, v in summary.items() if k != 'candidates'})}")
    found = [(c["text"][:30], c["val_score"], c["found_at_metric_calls"]) for c in summary["candidates"]]
    print(f"[gepa] candidates: {found}")
    assert summary["seed_val_score"] == 0.0 and summary["best_val_score"] == 1.0 and summary["best_text"] == HELPFUL
    # The budget: GEPA's metric calls, within its budget (it stops before an iteration once the budget is spent,
    # so the last iteration may pass it by its own calls), and the episodes played for them, as logged.
    logged = [json.loads(line) for line in (tmp_path / "run" / "evaluations.jsonl").read_text().splitlines()]
    assert summary["episodes_played"] == sum(len(entry["records"]) for entry in logged) <= summary["metric_calls"]
    assert summary["budget"] <= summary["metric_calls"] <= summary["budget"] + 2 * 2 + 4
    assert played[0] == "Help the customer." and HELPFUL in played
    # The reflection LM read the seed text, the ticket, what the agent did and the evaluator's feedback.
    first = requests[0]["messages"][-1]["content"]
    assert "Help the customer." in first and "reward 0.00 of 1.00" in first and "gold call not made" in first
    assert gepa_baseline.best_within(summary, 0) == "Help the customer."
    helpful = next(c for c in summary["candidates"] if c["text"] == HELPFUL)
    assert gepa_baseline.best_within(summary, helpful["found_at_metric_calls"]) == HELPFUL
    # A rerun on the finished workdir plays nothing and asks nothing (GEPA's seed evaluation, which it repeats
    # before loading its state, comes from the log; the budget is spent).
    with ScriptedLLMServer([]) as server:
        again = _optimize(tmp_path, server, played_again := [])
        assert server.requests == [] and played_again == []
    assert {**again, "seconds": 0} == {**summary, "seconds": 0}


def test_joined_guidance_names_each_capability_in_order_and_drops_empty_texts():
    texts = {"tool_calling": " Use exact arguments. ", "structured_data": "", "precondition": "Read first."}
    assert gepa_baseline.joined_guidance(texts) == "Tool calling: Use exact arguments.\n\nPrecondition: Read first."


def test_a_bad_gepa_setting_fails_naming_the_key():
    cfg = defaults(gepa_baseline.GepaSettings)
    assert from_config(gepa_baseline.GepaSettings, cfg, "gepa") == gepa_baseline.GepaSettings()
    cfg.reflection = "teacher"
    with pytest.raises(ValueError, match=r"config.gepa.reflection = 'teacher' is invalid; it must be one of local"):
        from_config(gepa_baseline.GepaSettings, cfg, "gepa")


def test_the_base_model_reflects_deterministically_and_a_long_prompt_keeps_its_ends(tiny_chat_model):
    model = load_model(tiny_chat_model)
    sampler = Sampler(model.cfg, model.params, max_context=256, detokenize=model.tokenizer.decode)
    lms = [
        gepa_baseline.LocalReflectionLM(model, sampler, max_new_tokens=16, temperature=1.0, seed=3) for _ in range(2)
    ]
    prompt = "Write a better instruction for the agent."
    first = [lm(prompt) for lm in lms]
    assert first[0] == first[1] == lms[0](prompt)  # one seed and prompt, one reply (a resumed run's too)
    assert lms[0](prompt + " Be brief.") != first[0]  # another prompt, another key
    long = "Write a better instruction. " + "The agent called the tool twice. " * 100 + "Reply in ``` blocks."
    assert len(model.tokenizer.apply_chat([{"role": "user", "content": long}])) > sampler.max_context
    assert lms[0](long).strip()  # uncut, the prompt would fill the context and leave no room for a reply
    ids = list(range(10))
    assert gepa_baseline.keep_ends(ids, 5) == [0, 1, 7, 8, 9] and gepa_baseline.keep_ends(ids, 10) == ids


class EndsItsTurn:
    """A sampler whose every reply is `reply` and the end-of-turn token it stops on, which the real sampler keeps
    in the completion's tokens and text (a random tiny model almost never samples that token itself)."""

    max_context = 256

    def __init__(self, tokenizer, reply: str):
        self.tokenizer, self.reply = tokenizer, reply

    def generate(self, prompts, *, key, max_new_tokens, temperature, stop_token_ids):
        ids = [*self.tokenizer.encode(self.reply), min(stop_token_ids)]
        return [[Completion(ids, [0.0] * len(ids), "stop", self.tokenizer.decode(ids))] for _ in prompts]


def test_the_base_models_reflection_is_its_reply_without_the_end_of_turn_token(tiny_chat_model):
    """GEPA takes the reflection's reply as a new guidance text for the system prompt, where an end-of-turn token
    would close the system turn early (seen with SmolLM2 as the reflection LM: "...<|im_end|>")."""
    model = load_model(tiny_chat_model)
    reply = "Read the order before you change it."
    sampler = EndsItsTurn(model.tokenizer, reply)
    assert (
        sampler.generate(
            [[1]], key=None, max_new_tokens=1, temperature=0.0, stop_token_ids=model.tokenizer.eos_token_ids
        )[0][0].text
        != reply
    )  # the marker's text
    lm = gepa_baseline.LocalReflectionLM(model, sampler, max_new_tokens=16, temperature=1.0, seed=3)
    assert lm("Write a better instruction for the agent.") == reply
