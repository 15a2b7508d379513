"""`python -m launch.serve` through the `openai` client on the loopback address, on the tiny random model with
SmolLM2's tokenizer and two random adapters (what is under test is the server, not the model): every served
model's greedy output equals the sampler's (and launch.generate's), concurrent requests sample what they sample
alone, streaming equals the whole reply, a conversation continues its row, bad requests get a 4xx and the
server goes on, a client that leaves frees its rows, and a load of concurrent clients completes."""

import asyncio
import json
import queue
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import numpy as np
import openai
import pytest
from multiprocess import failure_report

from launch.bench_serve import load, start_server
from trace_jax import lora, runtime
from trace_jax.models.model import load_model
from trace_jax.sampling import Sampler, Session
from trace_jax.serve.engine import ChoiceUpdate, GenerationRequest, ServingEngine
from trace_jax.serve.protocol import TextDeltas, assistant_reply
from trace_jax.tool_calls import format_tool_call

BATCH = 4
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order_details",
            "description": "Look up an order.",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
        },
    }
]
ASK = [{"role": "user", "content": "Where is my order #W2378156?"}]
KEY = "test-key"  # the server's --api_key
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model(tiny_chat_model):
    return load_model(tiny_chat_model)


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory) -> dict[str, str]:
    """Two PEFT adapters with random non-zero B: each changes the output its own way."""
    folders = {}
    for seed, name in enumerate(("alpha", "beta")):
        spec = lora.LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj"))
        stack = lora.init_adapters(jax.random.key(seed), model.cfg, spec)
        weights = {
            t: {"a": w["a"], "b": jax.random.normal(jax.random.key(10 + seed), w["b"].shape) * 0.5}
            for t, w in stack.weights.items()
        }
        folders[name] = str(tmp_path_factory.mktemp(name))
        lora.save_peft(lora.Adapters(weights, stack.scale), folders[name])
    return folders


@pytest.fixture(scope="module")
def server(tiny_chat_model, adapters, job_env):
    """The server's /v1 URL: the base as "tiny", the adapters by name, a batch of BATCH rows, on the fused
    sampler policy (an accelerator's: calls in flight while requests come and go), its replies compared with
    the library's default (adaptive) policy; the TRACE router's server (test_trace_pipeline) runs the adaptive."""
    named = ",".join(f"{name}={folder}" for name, folder in adapters.items())
    process, url = start_server(
        [
            f"--model={tiny_chat_model}",
            "--served_name=tiny",
            f"--adapters={named}",
            f"--batch={BATCH}",
            "--decode_chunk=8",
            "--sampler_policy=fused",
            f"--api_key={KEY}",
        ],
        env=job_env,
    )
    yield url
    process.terminate()
    process.wait(timeout=60)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=300)


def _generate(model, adapters, name: str, prompt_ids: list[int], max_new_tokens: int) -> str:
    """The library's greedy text for `prompt_ids` with adapter `name` ("tiny": none)."""
    stack = lora.load_peft(adapters[name], model.cfg) if name != "tiny" else None
    sampler = Sampler(
        model.cfg,
        model.params,
        adapters=stack,
        detokenize=lambda ids: model.tokenizer.decode(ids, skip_special_tokens=True),
    )
    (out,), _ = sampler.generate(
        [prompt_ids],
        key=jax.random.key(0),
        max_new_tokens=max_new_tokens,
        adapter_idx=lora.NO_ADAPTER if stack is None else 0,
        stop_token_ids=sorted(model.tokenizer.eos_token_ids),
    )
    return out.text


def _chat(client, model: str = "tiny", messages=ASK, **settings):
    return client.chat.completions.create(
        model=model, messages=messages, **{"max_tokens": 12, "temperature": 0, **settings}
    )


def test_each_served_model_answers_as_the_sampler_and_generate_do(client, model, adapters, job_env):
    assert [m.id for m in client.models.list()] == ["tiny", "alpha", "beta"]
    prompt_ids = model.tokenizer.apply_chat(ASK)
    texts = {}
    for name in ("tiny", "alpha", "beta"):
        reply = _chat(client, name)
        texts[name] = reply.choices[0].message.content
        assert reply.model == name and reply.usage.prompt_tokens == len(prompt_ids)
        assert texts[name] == _generate(model, adapters, name, prompt_ids, 12), name
    assert len(set(texts.values())) == 3  # each adapter is applied
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.generate",
            f"--model={model.path}",
            "--chat",
            "--json",
            f"--prompt={ASK[0]['content']}",
            f"--adapter={adapters['beta']}",
            "--max_new_tokens=12",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=job_env,
    )
    assert out.returncode == 0, failure_report(out)
    assert json.loads(out.stdout.strip().splitlines()[-1])["text"] == texts["beta"]


def test_concurrent_requests_sample_what_they_sample_alone(client):
    """Mixed adapters, lengths, greedy and seeded sampling, n > 1: more choices than rows, so rows are refilled as
    requests end; each reply equals the same request sent alone."""
    requests = [
        dict(
            model=["tiny", "alpha", "beta"][i % 3],
            max_tokens=[5, 17, 30][i % 3],
            messages=[{"role": "user", "content": f"Question {i}: " + "where is it? " * (i % 4)}],
            **({"temperature": 1.0, "seed": 100 + i, "n": 2} if i % 2 else {"temperature": 0}),
        )
        for i in range(8)
    ]
    texts = lambda reply: [c.message.content for c in reply.choices]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: texts(client.chat.completions.create(**r)), requests))
    alone = [texts(client.chat.completions.create(**r)) for r in requests]
    assert together == alone
    assert all(len(t) == 2 and t[0] != t[1] for t in together[1::2])  # n = 2: two streams


def test_streaming_gives_the_whole_reply_with_usage_logprobs_and_stop_strings(client):
    whole = _chat(client, "alpha", max_tokens=24, logprobs=True)
    content = whole.choices[0].message.content
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens
    chunks = list(
        _chat(client, "alpha", max_tokens=24, logprobs=True, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert (
        sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
        == whole.usage.completion_tokens
    )
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    stop = content[len(content) // 2 :][:4]  # a stop string in the middle of the reply
    cut = _chat(client, "alpha", max_tokens=24, stop=[stop])
    assert cut.choices[0].message.content == content[: content.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = _chat(client, "alpha", max_tokens=24, stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == content[: content.index(stop)]


def test_text_completions_take_strings_and_token_ids(client, model, adapters):
    ids = model.tokenizer.encode("The order was")
    reply = client.completions.create(model="beta", prompt=[ids, "The order was"], max_tokens=10, temperature=0, n=2)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert len({c.text for c in reply.choices}) == 1 and reply.choices[0].text == _generate(
        model, adapters, "beta", ids, 10
    )
    chunks = list(client.completions.create(model="beta", prompt=ids, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_tools_and_tool_results_render_into_the_prompt(client, model):
    """A conversation with a tool call and its result, tools given: the prompt is the chat template's rendering
    of both (a random model makes no tool call itself: the reply side is checked below on a written one)."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_order_details", "arguments": json.dumps({"order_id": "#W2378156"})},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"status": "delivered"}'},
    ]
    reply = _chat(client, "beta", messages=messages, tools=TOOLS)
    assert reply.usage.prompt_tokens == len(model.tokenizer.apply_chat(messages, tools=TOOLS))
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_written_tool_call_becomes_openai_tool_calls_whole_and_streamed(model):
    text = "Let me look.\n" + format_tool_call("get_order_details", {"order_id": "#W2378156"})
    content, calls = assistant_reply(text, TOOLS)
    assert content == "Let me look." and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_order_details", "arguments": '{"order_id": "#W2378156"}'}
    ids = model.tokenizer.encode(text)
    deltas = TextDeltas(lambda t: model.tokenizer.decode(t, skip_special_tokens=True), (), TOOLS)
    streamed = "".join(deltas.update(ids[:k]) for k in range(1, len(ids) + 1))
    rest, streamed_calls = deltas.finish(text)
    assert (streamed + rest).strip() == content and "<tool" not in streamed
    assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls]
    broken = 'Let me look.\n<tool_call>\n{"name": "get_order_details", "arguments": {"order_id": 5}}'
    assert assistant_reply(broken, TOOLS) == (broken, None)  # schema-invalid: returned as written
    assert assistant_reply(text, None) == (text, None)  # no tools: text


def test_a_conversation_continues_its_row(client, model, adapters):
    first = _chat(client, "alpha", max_tokens=8)
    messages = [
        *ASK,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And when will it arrive?"},
    ]
    second = _chat(client, "alpha", messages=messages, max_tokens=8)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    prompt_ids = model.tokenizer.apply_chat(messages)
    assert second.choices[0].message.content == _generate(model, adapters, "alpha", prompt_ids, 8)


@pytest.mark.parametrize(
    "body, status, message",
    [
        ("{not json", 400, "not valid JSON"),
        ({"model": "gpt-9", "messages": ASK}, 404, "does not exist here"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "order " * 9000}]}, 400, "context holds"),
        (
            {"model": "tiny", "messages": ASK, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            400,
            "tools\\[0\\].function.name",
        ),
        (
            {
                "model": "tiny",
                "messages": ASK,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            },
            400,
            "parameters must be a JSON schema",
        ),
        ({"model": "tiny", "messages": ASK, "temperature": 3}, 400, "temperature must be"),
        ({"model": "tiny", "messages": ASK, "n": BATCH + 1}, 400, "n must be"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages\\[0\\]"),
        ({"model": "tiny", "messages": ASK, "top_logprobs": 3}, 400, "top_logprobs is not supported"),
        ({"model": "tiny", "messages": ASK, "stop": 5}, 400, "stop must be"),
        ({"model": "tiny", "messages": ASK, "response_format": "json"}, 400, "response_format"),
    ],
)
def test_a_bad_request_gets_a_4xx_and_the_server_goes_on(server, client, body, status, message):
    content = body if isinstance(body, str) else json.dumps(body)
    reply = httpx.post(
        f"{server}/chat/completions", content=content, headers={**AUTH, "content-type": "application/json"}, timeout=60
    )
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert re.search(message, error["message"]), error
    assert _chat(client, max_tokens=2).choices[0].finish_reason == "length"


@pytest.mark.parametrize("prompt", ["", [49152 * 2]])
def test_an_empty_prompt_or_an_unknown_token_gets_a_400(server, prompt):
    reply = httpx.post(f"{server}/completions", json={"model": "tiny", "prompt": prompt}, headers=AUTH, timeout=60)
    assert reply.status_code == 400 and "at least one token" in reply.json()["error"]["message"], reply.text


def test_a_client_that_leaves_frees_its_rows(server, client):
    base = server.removesuffix("/v1")
    before = httpx.get(f"{base}/stats", headers=AUTH).json()
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4000, "temperature": 1}
    for i in range(BATCH):  # every row busy with a long reply; each client leaves early
        if i % 2:  # streamed: after its first chunk
            with httpx.stream(
                "POST", f"{server}/chat/completions", json={**body, "stream": True}, headers=AUTH, timeout=60
            ) as s:
                next(s.iter_lines())
        else:  # whole: when its own timeout strikes
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server}/chat/completions", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=0.5))
    deadline = time.monotonic() + 60
    while (stats := httpx.get(f"{base}/stats", headers=AUTH).json())["running_rows"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats["running_rows"] == 0 and stats.get("cancelled", 0) - before.get("cancelled", 0) == BATCH, stats
    assert _chat(client, max_tokens=2).choices[0].finish_reason == "length"


def test_a_load_of_concurrent_clients_completes(server):
    result = asyncio.run(load(server, clients=16, requests=32, lengths=[4, 16], duration_s=600, api_key=KEY))
    print(f"\n[serve] load test: {json.dumps(result)}")
    assert result["errors"] == 0 and result["requests"] == 32, result["first_errors"]
    assert result["models"] == ["tiny", "alpha", "beta"] and result["tokens_per_s"] > 0


def test_bad_requests_get_a_4xx_within_a_second_while_a_stream_goes_on(server, client):
    """Settings out of range, a 10 MB body, deeply nested JSON, a missing key or a non-JSON Content-Type are
    each refused before the engine sees them, at once, while another client's stream goes on to its end."""
    lines: list[str] = []

    def stream() -> None:
        body = {"model": "tiny", "messages": ASK, "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server}/chat/completions", json=body, headers=AUTH, timeout=300) as s:
            lines.extend(line for line in s.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    ok = {"model": "tiny", "messages": ASK, "max_tokens": 2}
    as_json = {**AUTH, "content-type": "application/json"}
    cases = [
        (json.dumps({**ok, "top_k": 2**31}), as_json, 400, "top_k must be an integer in"),
        (json.dumps({**ok, "n": 10**9}), as_json, 400, "n must be an integer in"),
        (json.dumps({**ok, "pad": "x" * 10 * 2**20}), as_json, 413, "over this server's"),
        ("[" * 10_000 + "]" * 10_000, as_json, 400, "nested too deeply"),
        (json.dumps(ok), {"content-type": "application/json"}, 401, "Incorrect API key"),
        (json.dumps(ok), {**AUTH, "content-type": "text/plain"}, 415, "Content-Type must be application/json"),
    ]
    for content, headers, status, message in cases:
        start = time.monotonic()
        reply = httpx.post(f"{server}/chat/completions", content=content, headers=headers, timeout=30)
        elapsed = time.monotonic() - start
        assert reply.status_code == status and message in reply.json()["error"]["message"], reply.text
        assert elapsed < 1.0, (message, elapsed)
    reader.join(timeout=300)
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines[-3:]
    assert any('"finish_reason": "length"' in line or '"finish_reason": "stop"' in line for line in lines)
    assert _chat(client, max_tokens=2).choices[0].finish_reason == "length"


def test_an_engine_error_fails_only_the_request_that_caused_it_and_the_engine_goes_on(model, monkeypatch):
    """A request the session refuses at admission fails alone (the two admitted with it are fed again and
    finish); a failed decode step fails the running request, and the next one is served by a new session."""
    tokenizer = model.tokenizer
    sampler = Sampler(model.cfg, model.params, decode_chunk=8, detokenize=tokenizer.decode)
    engine = ServingEngine(sampler, sorted(tokenizer.eos_token_ids), batch=BATCH)
    prompt = tuple(tokenizer.apply_chat(ASK))
    feed, step = Session.feed, Session.step

    def refusing_feed(self, rows, prompts, **settings):
        if 7 in np.atleast_1d(settings["top_k"]):
            raise ValueError("top_k = 7 cannot be fed")
        return feed(self, rows, prompts, **settings)

    def play(*top_ks: int) -> list[ChoiceUpdate]:
        ends = [queue.Queue() for _ in top_ks]
        with engine._wake:  # submitted together: admitted in one batch
            for top_k, end in zip(top_ks, ends):
                callback = lambda update, end=end: (update.error or update.finish_reason) and end.put(update)
                engine.submit(GenerationRequest(prompt, 4, top_k=top_k), callback)
        return [end.get(timeout=120) for end in ends]

    monkeypatch.setattr(Session, "feed", refusing_feed)
    first, refused, third = play(0, 7, 0)
    assert "top_k = 7 cannot be fed" in refused.error
    assert first.error is None and third.error is None and len(first.token_ids) == len(third.token_ids) == 4
    monkeypatch.setattr(Session, "step", lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError("device lost")))
    (failed,) = play(0)
    assert "generation failed: RuntimeError: device lost" in failed.error
    monkeypatch.setattr(Session, "step", step)
    (served,) = play(0)
    assert served.error is None and served.token_ids == first.token_ids
    engine.close()


def test_the_engines_loop_keeps_its_memory_up_as_it_serves(model, monkeypatch):
    """A server runs for days meeting new shapes: its loop hands the freed heap back and bounds its memory maps
    (`runtime.Upkeep`, here on every pass)."""
    kept = []
    monkeypatch.setattr("trace_jax.runtime.UPKEEP_EVERY_S", 0.0)
    monkeypatch.setattr(runtime, "release_freed_memory", lambda: kept.append("heap"))
    monkeypatch.setattr(runtime, "bound_memory_maps", lambda: kept.append("maps"))
    tokenizer = model.tokenizer
    sampler = Sampler(model.cfg, model.params, decode_chunk=8, detokenize=tokenizer.decode)
    engine = ServingEngine(sampler, sorted(tokenizer.eos_token_ids), batch=1)
    end = queue.Queue()
    done = lambda update: (update.error or update.finish_reason) and end.put(update)
    engine.submit(GenerationRequest(tuple(tokenizer.apply_chat(ASK)), 4), done)
    assert end.get(timeout=120).error is None
    engine.close()
    assert kept.count("heap") == kept.count("maps") >= 1
