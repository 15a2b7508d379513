"""The embedded Gemma 3 270M (google's base model, Q4_K_M GGUF): our conversion and decoder against transformers
loading the same GGUF itself (`gguf_file=`), an independent reference on real weights, on a prompt longer than
the 512-token sliding window so that the local layers' window matters; and the chat format the model is given."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from trace_jax.models.decoder import forward
from trace_jax.models.embedded import embedded_gguf_path, embedded_model_dir
from trace_jax.models.model import load_model

NAME = "gemma-3-270m"
TEXT = (
    "The history of the written word spans thousands of years, from clay tablets to printed books and screens. "
    "Scribes copied manuscripts by hand, printers set type, and readers passed stories on. "
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return load_model(embedded_model_dir(NAME, cache_dir=tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def reference():
    gguf = embedded_gguf_path(NAME)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return tokenizer, model.eval()


def test_the_converted_gemma_matches_transformers_reading_the_gguf_past_the_sliding_window(converted, reference):
    tokenizer, model = reference
    cfg = converted.cfg
    assert cfg.family == "gemma3" and cfg.sliding_window == 512 and cfg.num_layers == 18
    assert [i for i, local in enumerate(cfg.local_layers) if not local] == [5, 11, 17]
    ids = tokenizer.encode(TEXT * 20)
    assert len(ids) > 600 and ids == [
        converted.tokenizer.tokenizer.bos_token_id,
        *converted.tokenizer.encode(TEXT * 20),
    ]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits.numpy()
    ours, _ = forward(converted.params, jnp.asarray([ids]), cfg)
    ours = np.asarray(ours)
    scale, error = np.abs(ref).max(), np.abs(ours - ref).max()
    print(f"\n[gemma3] {len(ids)} tokens: max |logit difference| {error:.2e} against max |logit| {scale:.1f}")
    assert error <= 1e-4 * scale
    assert (ours[0].argmax(-1) == ref[0].argmax(-1)).mean() >= 0.999


def test_gemma_turns_render_in_its_own_format(converted):
    rendered = converted.tokenizer.decode(
        converted.tokenizer.apply_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}])
    )
    assert rendered == "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\n"
    assert converted.tokenizer.tokenizer.convert_tokens_to_ids("<end_of_turn>") in converted.tokenizer.eos_token_ids
    bos = converted.tokenizer.tokenizer.bos_token_id
    assert converted.tokenizer.encode("Hi", add_special_tokens=True)[0] == bos  # a raw prompt starts as Gemma's do
    assert bos not in converted.tokenizer.encode("Hi")  # a continuation does not


def test_a_tool_conversation_through_gemmas_template_is_encoded_incrementally_and_parses_back(converted):
    """The project's tool-call format (instructions in the system prompt, `<tool_call>` blocks, results as
    `<tool_response>` user turns) rendered by Gemma's template: the tokens an episode feeds turn by turn equal
    the encoding of the whole conversation, and the calls the model would emit parse back to themselves."""
    from trace_jax.agent.chat_codec import ChatCodec
    from trace_jax.tool_calls import format_tool_call, parse_assistant_output

    tokenizer = converted.tokenizer
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_order_details",
                "description": "Look up an order.",
                "parameters": {
                    "type": "object",
                    "properties": {"order_id": {"type": "string"}},
                    "required": ["order_id"],
                },
            },
        }
    ]
    codec = ChatCodec(tokenizer, tools)
    messages = [
        {"role": "system", "content": "You are a retail agent."},
        {"role": "user", "content": "Where is order #W1?"},
    ]
    ids = codec.first_prompt(messages)
    call = format_tool_call("get_order_details", {"order_id": "#W1"})
    turns = [
        (call, [{"role": "tool", "content": '{"status": "delivered"}'}]),
        ("It was delivered.", [{"role": "user", "content": "Thanks!"}]),
    ]
    for reply, observations in turns:
        ids += codec.assistant_turn(reply)
        parsed = parse_assistant_output(tokenizer.decode(codec.assistant_turn(reply)[:-1]), tools)
        assert parsed.errors == () and [(c.name, c.arguments) for c in parsed.tool_calls] == (
            [("get_order_details", {"order_id": "#W1"})] if reply == call else []
        )
        ids += codec.continuation([*messages, {"role": "assistant", "content": reply}], observations)
        messages += [{"role": "assistant", "content": reply}, *observations]

    assert ids == tokenizer.apply_chat(messages, tools=tools)
    rendered = tokenizer.decode(ids)
    assert rendered.startswith("<bos><start_of_turn>user\nYou are a retail agent.\n\n")
    assert "get_order_details" in rendered.split("<end_of_turn>")[0]  # the tool list, in the first user turn
    assert '<start_of_turn>user\n<tool_response>\n{"status": "delivered"}\n</tool_response><end_of_turn>' in rendered
    assert rendered.endswith("<start_of_turn>user\nThanks!<end_of_turn>\n<start_of_turn>model\n")
