"""The embedded SmolLM2-135M-Instruct: our forward and greedy decoding against transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from trace_jax.models.decoder import forward
from trace_jax.models.embedded import embedded_gguf_path
from trace_jax.sampling import Sampler

LONG_QUESTIONS = [
    "List three colours of the rainbow and explain why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
]


@pytest.fixture(scope="module")
def hf_model(smollm2):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2.path, dtype=torch.float32).eval()


def test_logits_match_transformers(smollm2, hf_model):
    ids = smollm2.tokenizer.apply_chat([{"role": "user", "content": LONG_QUESTIONS[0]}])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits.numpy()
    ours, _ = forward(smollm2.params, jnp.asarray([ids]), smollm2.cfg)
    assert np.abs(np.asarray(ours) - ref).max() <= 1e-3


def test_greedy_decoding_matches_transformers_generate(smollm2, hf_model):
    """32 greedy tokens for long answers, and the same early stop at <|im_end|> for a short one."""
    tok = smollm2.tokenizer
    questions = {q: 32 for q in LONG_QUESTIONS} | {"What is the capital of France?": None}
    prompts = [tok.apply_chat([{"role": "user", "content": q}]) for q in questions]
    sampler = Sampler(smollm2.cfg, smollm2.params)
    outs, _ = sampler.generate(
        prompts,
        key=jax.random.key(0),
        max_new_tokens=32,  # rows of different lengths
        stop_token_ids=sorted(tok.eos_token_ids),
    )
    for prompt, out, expected_len in zip(prompts, outs, questions.values()):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id
            )[0, len(prompt) :].tolist()
        assert out.token_ids == ref
        assert len(ref) == expected_len if expected_len else ref[-1] in tok.eos_token_ids
    assert "Paris" in tok.decode(outs[-1].token_ids)


def test_the_gguf_conversion_matches_transformers_reading_the_gguf_itself(smollm2):
    """An independent check of `convert_gguf`: transformers de-quantises the embedded GGUF on its own
    (`gguf_file=`); its tokenizer and logits must equal ours from the converted folder."""
    gguf = embedded_gguf_path("smollm2-135m-instruct")
    reference = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for question in [*LONG_QUESTIONS, "ünïcödé 🙂\n\n  indented\ttab"]:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
        ids = smollm2.tokenizer.apply_chat(messages)
        text = reference_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ids == reference_tokenizer.encode(text, add_special_tokens=False)
        with torch.no_grad():
            ref = reference.eval()(torch.tensor([ids])).logits.numpy()
        ours, _ = forward(smollm2.params, jnp.asarray([ids]), smollm2.cfg)
        assert np.abs(np.asarray(ours) - ref).max() <= 1e-3
