"""The LLM client (the real `openai` library) against a real scripted OpenAI-compatible server on
127.0.0.1: the request sent, the disk cache, seeds, JSON repair, transport retries, config and environment."""

import json

import pytest
from scripted_llm_server import Fail, ScriptedLLMServer

from trace_jax.llm import ChatClient, LLMError, LlmSettings, MalformedReply, extract_json
from trace_jax.settings import defaults, from_config

MESSAGES = [{"role": "system", "content": "You list capabilities."}, {"role": "user", "content": "List them."}]
GOOD_JSON = 'Here it is:\n```json\n{"capabilities": ["lookup", "refund"]}\n```'


def make_client(base_url: str, cache_dir, **overrides) -> ChatClient:
    return ChatClient(LlmSettings(**dict(model="scripted-model", base_url=base_url, **overrides)), cache_dir)


def capabilities(value) -> list[str]:
    """A validator: the reply must be {"capabilities": [str, ...]}."""
    if not isinstance(value, dict) or not isinstance(value.get("capabilities"), list):
        raise ValueError('expected an object {"capabilities": [...]}')
    if not all(isinstance(c, str) for c in value["capabilities"]):
        raise ValueError("capabilities must be a list of strings")
    return value["capabilities"]


def test_complete_returns_the_content_and_sends_model_messages_temperature(tmp_path):
    with ScriptedLLMServer(["Hello there."]) as server:
        client = make_client(server.base_url, tmp_path)
        assert client.complete(MESSAGES, temperature=0.25) == "Hello there."
    [request] = server.requests
    assert request["model"] == "scripted-model"
    assert request["messages"] == MESSAGES
    assert request["temperature"] == 0.25
    assert request["max_tokens"] == 4096 and request["seed"] == 0
    assert client.stats == {"requests": 1, "cache_hits": 0, "malformed": 0, "failed": 0}


def test_identical_request_is_served_from_the_disk_cache_and_a_new_sample_is_not(tmp_path):
    with ScriptedLLMServer(["first", "second"]) as server:
        client = make_client(server.base_url, tmp_path)
        assert client.complete(MESSAGES) == "first"
        assert client.complete(MESSAGES) == "first"
        assert len(server.requests) == 1 and client.stats["cache_hits"] == 1 and client.stats["requests"] == 1

        fresh = make_client(server.base_url, tmp_path)
        assert fresh.complete(MESSAGES) == "first"
        assert len(server.requests) == 1 and fresh.stats["cache_hits"] == 1 and fresh.stats["requests"] == 0

        assert client.complete(MESSAGES, sample=1) == "second"
    assert [r["seed"] for r in server.requests] == [0, 1]
    files = sorted(tmp_path.rglob("*"))
    cached = [f for f in files if f.is_file()]
    assert len(cached) == 2, files  # one per request, no temp files left behind
    for path in cached:
        assert path.suffix == ".json" and path.parent.name == path.stem[:2]
        entry = json.loads(path.read_text())
        assert entry["request"]["messages"] == MESSAGES and entry["response"] in ("first", "second")


def test_without_a_cache_dir_every_call_is_a_request(tmp_path):
    with ScriptedLLMServer(["one", "two"]) as server:
        client = make_client(server.base_url, None)
        assert [client.complete(MESSAGES), client.complete(MESSAGES)] == ["one", "two"]
    assert client.stats["requests"] == 2 and client.stats["cache_hits"] == 0


def test_complete_json_recovers_from_a_malformed_reply(tmp_path):
    with ScriptedLLMServer(["Sure! {not json", GOOD_JSON]) as server:
        client = make_client(server.base_url, tmp_path)
        assert client.complete_json(MESSAGES, capabilities) == ["lookup", "refund"]
        again = make_client(server.base_url, tmp_path)  # each attempt was cached under its own conversation
        assert again.complete_json(MESSAGES, capabilities) == ["lookup", "refund"]
    assert client.stats == {"requests": 2, "cache_hits": 0, "malformed": 1, "failed": 0}
    assert again.stats == {"requests": 0, "cache_hits": 2, "malformed": 1, "failed": 0}
    retry = server.requests[1]["messages"]
    assert retry[:2] == MESSAGES
    assert retry[2] == {"role": "assistant", "content": "Sure! {not json"}
    assert retry[3]["role"] == "user"
    assert "no JSON object or array" in retry[3]["content"] and "property name" in retry[3]["content"]


def test_a_reply_nested_too_deeply_is_malformed_and_a_rerun_from_the_cache_recovers_too(tmp_path):
    deep = "[" * 100_000
    with pytest.raises(ValueError, match="nested too deeply"):
        extract_json(deep)
    with ScriptedLLMServer([deep, GOOD_JSON]) as server:
        assert make_client(server.base_url, tmp_path).complete_json(MESSAGES, capabilities) == ["lookup", "refund"]
    again = make_client("http://127.0.0.1:9", tmp_path)  # no server: both replies come from the cache
    assert again.complete_json(MESSAGES, capabilities) == ["lookup", "refund"]
    assert again.stats == {"requests": 0, "cache_hits": 2, "malformed": 1, "failed": 0}


def test_a_validator_error_is_treated_like_malformed_json(tmp_path):
    with ScriptedLLMServer(['{"capabilities": [1, 2]}', GOOD_JSON]) as server:
        client = make_client(server.base_url, tmp_path)
        assert client.complete_json(MESSAGES, capabilities) == ["lookup", "refund"]
    assert client.stats["malformed"] == 1 and client.stats["failed"] == 0
    assert "capabilities must be a list of strings" in server.requests[1]["messages"][-1]["content"]


def test_complete_json_gives_up_after_max_json_attempts(tmp_path):
    with ScriptedLLMServer(["no", "[still no", "unused"]) as server:
        client = make_client(server.base_url, tmp_path, max_json_attempts=2)
        with pytest.raises(MalformedReply, match="2 attempts"):
            client.complete_json(MESSAGES, capabilities)
    assert len(server.requests) == 2
    assert client.stats == {"requests": 2, "cache_hits": 0, "malformed": 2, "failed": 1}


def test_the_openai_transport_retry_gets_the_reply_after_an_http_500(tmp_path):
    with ScriptedLLMServer([Fail(500, "overloaded"), "recovered"]) as server:
        client = make_client(server.base_url, tmp_path, max_retries=1)
        assert client.complete(MESSAGES) == "recovered"
    assert len(server.requests) == 2 and client.stats["requests"] == 1


def test_api_errors_and_empty_replies_become_llm_errors(tmp_path):
    with ScriptedLLMServer([Fail(400, "unknown model"), ""]) as server:
        client = make_client(server.base_url, tmp_path, max_retries=0)
        with pytest.raises(LLMError, match="HTTP 400.*unknown model"):
            client.complete(MESSAGES)
        with pytest.raises(LLMError, match="empty reply"):
            client.complete(MESSAGES, sample=1)
    assert not [f for f in tmp_path.rglob("*") if f.is_file()]  # failures are not cached


def test_the_exhausted_script_answers_500(tmp_path):
    with ScriptedLLMServer([]) as server:
        client = make_client(server.base_url, tmp_path, max_retries=0)
        with pytest.raises(LLMError, match="HTTP 500.*script is exhausted"):
            client.complete(MESSAGES)


@pytest.mark.parametrize(
    "key, value",
    [("model", ""), ("temperature", -1.0), ("max_json_attempts", 0), ("api_key_env", ""), ("max_retries", -1)],
)
def test_a_bad_config_names_its_key(key, value):
    cfg = defaults(LlmSettings)
    cfg.model = "m"
    cfg[key] = value
    with pytest.raises(ValueError, match=rf"llm\.{key}\b"):
        from_config(LlmSettings, cfg, "llm")


def test_the_empty_model_message_says_how_to_set_it():
    with pytest.raises(ValueError, match=r"llm\.model.*--config\.llm\.model="):
        from_config(LlmSettings, defaults(LlmSettings), "llm")


def test_base_url_and_api_key_come_from_the_environment(tmp_path, monkeypatch):
    with ScriptedLLMServer(["from env", "placeholder"]) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-123")
        assert make_client("", tmp_path).complete(MESSAGES) == "from env"
        monkeypatch.delenv("OPENAI_API_KEY")
        assert make_client("", tmp_path).complete(MESSAGES, sample=1) == "placeholder"
    assert [h["authorization"] for h in server.headers] == ["Bearer sk-test-123", "Bearer unused"]


@pytest.mark.parametrize(
    "text, value",
    [
        ('{"a": 1}', {"a": 1}),
        ("  [1, 2]\n", [1, 2]),
        ('```json\n{"a": "x"}\n```', {"a": "x"}),
        ('Note {braces} here, then:\n```\n[{"a": 2}]\n```', [{"a": 2}]),
        ('The answer is {"a": "}"} as asked.', {"a": "}"}),
        ('Try {nope} or ["ok"] instead.', ["ok"]),
    ],
)
def test_extract_json(text, value):
    assert extract_json(text) == value


def test_extract_json_without_json_raises_value_error():
    with pytest.raises(ValueError, match="no JSON object or array"):
        extract_json("I cannot help with that.")
