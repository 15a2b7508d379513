"""TRACE stage 4's router (on the tiny random model with SmolLM2's tokenizer and chat template): single-token
labels checked at start, and every decision and label logit equal to an independent transformers
computation (its own tokenizer and chat template, its own forward) on the same prompts."""

import logging

import numpy as np
import pytest
import torch
import transformers

from trace_jax.envs.embedded_retail import EmbeddedRetail
from trace_jax.models.model import load_model
from trace_jax.trace.routing import NO_ADAPTER, RouteOption, Router, calibrate, label_token_ids, router_messages

OPTIONS = [
    RouteOption(
        "tool_calling",
        "Makes the write call a request needs with exactly the right arguments.",
        'cancel_pending_order(order_id="#W1", reason="no longer needed")',
    ),
    RouteOption(
        "communication",
        "States the facts the customer asked for in the final reply.",
        "Your order #W2 is delivered; you paid 52.1.",
    ),
    RouteOption(
        "precondition",
        "Checks the order's status before acting and refuses what the policy forbids.",
        "Order #W3 is delivered, so it cannot be cancelled.",
    ),
]


@pytest.fixture(scope="module")
def model(tiny_chat_model):
    return load_model(tiny_chat_model)


@pytest.fixture(scope="module")
def conversations():
    env = EmbeddedRetail()
    return [env.episode(task).reset() for task in env.tasks("heldout", 5)]  # tickets of five families


def test_labels_must_be_single_distinct_tokens(model):
    assert len(label_token_ids(model.tokenizer, list("ABCDE"))) == 5
    with pytest.raises(ValueError, match="router label 'Zebra crossing' is .* tokens"):
        label_token_ids(model.tokenizer, ["A", "Zebra crossing"])
    with pytest.raises(ValueError, match="at most 25"):
        Router(model, OPTIONS * 9)


def test_decisions_equal_an_independent_transformers_computation(model, conversations, caplog):
    router = Router(model, OPTIONS, batch_size=4)  # 5 conversations: a full and a partial batch
    with caplog.at_level(logging.INFO):
        indices, weights, offsets = router.route(conversations)  # silent, as a server routes
        assert not [m for m in caplog.messages if m.startswith("conversation ")]
        logits = Router(model, OPTIONS, batch_size=4, log_every_s=0.0).logits(conversations)  # a pipeline's
    progress = [m.split("  ")[0] for m in caplog.messages if m.startswith("conversation ")]
    assert progress == ["conversation 4/5 (80%)", "conversation 5/5 (100%)"]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model.path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    label_ids = [hf_tokenizer.convert_tokens_to_ids(label) for label in "ABCD"]
    for row, conversation in enumerate(conversations):
        messages = router_messages(OPTIONS, conversation, list("ABCD"))
        encoded = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        ids = list(encoded["input_ids"])
        assert ids == router.prompt_ids(conversation)
        with torch.no_grad():
            reference = hf_model(torch.tensor([ids])).logits[0, -1, label_ids].numpy()
        assert np.abs(logits[row] - reference).max() <= 1e-3, row
        assert indices[row] == int(reference.argmax()) - 1
    assert np.allclose(weights.sum(axis=1), 1.0) and (weights.argmax(axis=1) - 1 == np.array(indices)).all()
    assert set(indices) <= {NO_ADAPTER, 0, 1, 2} and not offsets.any()  # no calibration
    # Batch calibration decides on the same (checked) logits less each label's mean over the five tickets.
    batch = Router(model, OPTIONS, batch_size=4, calibration="batch")
    calibrated, _, offsets = batch.route(conversations)
    assert calibrated == [int(i) - 1 for i in (logits - logits.mean(axis=0)).argmax(axis=1)]
    # One conversation at a time with the batch's offsets (a server's routing) decides as the batch did.
    assert [batch.route([c], offsets)[0][0] for c in conversations] == calibrated


def test_batch_calibration_removes_a_bias_shared_by_every_task():
    logits = np.random.RandomState(0).randn(12, 4)
    biased = logits + np.array([3.0, 0.0, -1.0, 0.5])  # the label prior a small router has
    assert (calibrate(biased, "batch").argmax(1) == calibrate(logits, "batch").argmax(1)).all()
    assert (calibrate(biased, "none") == biased).all() and (calibrate(biased, "none").argmax(1) == 0).mean() > 0.5
    assert np.allclose(calibrate(logits, "batch").mean(axis=0), 0.0)
    with pytest.raises(ValueError, match="router calibration 'contextual'"):
        calibrate(logits, "contextual")
