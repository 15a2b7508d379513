"""TRACE stage 4, Select & Adapt: the frozen base model picks one capability adapter (or none) per task.

The router prompt lists each option under a single-token label: "A" is general service
(no adapter: the base model), then one label per capability with its description and one
successful example from its environment. The task's opening messages follow (the last
`max_messages` of them, system prompt left out), then the question. The label whose token has
the highest next-token logit wins, and its adapter serves the whole episode; a softmax over
the label logits gives the weights reported beside the decision.

A small router has a strong prior for some labels whatever the conversation (SmolLM2-135M puts
0.6-0.7 on "A" for every retail ticket). `calibration="batch"` removes it as batch calibration
does (Zhou et al., 2024), in log space: each label's logit less its mean over the routed tasks,
so a bias the model adds to one label for every task changes no decision. It needs no labels.
"""

from __future__ import annotations

import dataclasses
import functools
import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.envs.base import Message
from trace_jax.metrics import Progress
from trace_jax.models.decoder import forward
from trace_jax.models.model import Model
from trace_jax.models.tokenizer import ChatTokenizer

NO_ADAPTER = -1  # the adapter index of general service: the base model alone
CALIBRATIONS = ("none", "batch")
GENERAL = ("general_service", "No specialised training: for requests that no other skill fits.")

INSTRUCTION = (
    "You are the routing classifier of a customer-service agent system. Each skill below is a version "
    "of the agent trained for one capability. Read the conversation and pick the skill that should "
    "handle it."
)
QUESTION = "Which skill should handle the next response? Answer with the skill's letter only."


@dataclasses.dataclass(frozen=True)
class RouteOption:
    """A capability the router can pick: its name, when to use it, and one successful example."""

    name: str
    description: str
    example: str


def label_token_ids(tokenizer: ChatTokenizer, labels: Sequence[str]) -> list[int]:
    """Each label's one token id; a label that is not one token is an error naming it."""
    ids = []
    for label in labels:
        tokens = tokenizer.encode(label)
        if len(tokens) != 1:
            raise ValueError(
                f"router label {label!r} is {len(tokens)} tokens in this tokenizer ({tokens}); "
                "every label must be exactly one token"
            )
        ids.append(tokens[0])
    if len(set(ids)) != len(ids):
        raise ValueError(f"router labels {list(labels)} share a token")
    return ids


def router_messages(
    options: Sequence[RouteOption], conversation: Sequence[Message], labels: Sequence[str], max_messages: int = 10
) -> list[Message]:
    """The router's chat: the skills under their labels (general service first), then the conversation."""
    skills = [f"{labels[0]}: {GENERAL[0]} - {GENERAL[1]}"]
    for label, option in zip(labels[1:], options):
        skills.append(f"{label}: {option.name} - {option.description}\n   Example of its work: {option.example}")
    shown = [m for m in conversation if m["role"] != "system"][-max_messages:]
    lines = [f"{m['role']}: {m.get('content') or ''}" for m in shown]
    return [
        {"role": "system", "content": INSTRUCTION + "\n\nSkills:\n" + "\n".join(skills)},
        {"role": "user", "content": "Conversation:\n" + "\n".join(lines) + "\n\n" + QUESTION},
    ]


def calibration_offsets(logits: np.ndarray, method: str) -> np.ndarray:
    """[labels]: what the decision subtracts from each label's logit of [N, labels] `logits`: nothing ("none"),
    or its mean over the N tasks ("batch")."""
    if method not in CALIBRATIONS:
        raise ValueError(f"router calibration {method!r}; choose one of {', '.join(CALIBRATIONS)}")
    if method == "batch" and len(logits):
        return logits.mean(axis=0)
    return np.zeros(logits.shape[1:], logits.dtype)


def calibrate(logits: np.ndarray, method: str) -> np.ndarray:
    """[N, labels] logits as the decision reads them (`calibration_offsets` subtracted)."""
    return logits - calibration_offsets(logits, method)


@functools.partial(jax.jit, static_argnames="cfg")
def _last_logits(params, tokens, lengths, label_ids, cfg):
    """The label logits at each row's last real token (rows right-padded: causal attention keeps them exact)."""
    logits, _ = forward(params, tokens, cfg)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return last[:, label_ids]


class Router:
    """Routes conversations among `options` with `model` (no adapter), one decision per conversation;
    `log_every_s` logs progress through the conversations routed in one call (None: silent, as a server is)."""

    def __init__(
        self,
        model: Model,
        options: Sequence[RouteOption],
        max_messages: int = 10,
        batch_size: int = 8,
        calibration: str = "none",
        log_every_s: float | None = None,
    ):
        if len(options) + 1 > len(string.ascii_uppercase):
            raise ValueError(f"{len(options)} capabilities: the router has labels for at most 25")
        calibrate(np.zeros((0, 1)), calibration)  # fails now on an unknown method
        self.calibration = calibration
        self.model, self.options = model, list(options)
        self.labels = list(string.ascii_uppercase[: len(options) + 1])
        self.label_ids = label_token_ids(model.tokenizer, self.labels)
        self.max_messages, self.batch_size, self.log_every_s = max_messages, batch_size, log_every_s

    def prompt_ids(self, conversation: Sequence[Message]) -> list[int]:
        """The token ids the router reads for one conversation (ending where the label is predicted)."""
        messages = router_messages(self.options, conversation, self.labels, self.max_messages)
        return self.model.tokenizer.apply_chat(messages, add_generation_prompt=True)

    def logits(self, conversations: Sequence[Sequence[Message]]) -> np.ndarray:
        """[N, options + 1] next-token logits of the labels (column 0: general service)."""
        prompts = [self.prompt_ids(c) for c in conversations]
        out = []
        progress = (
            None if self.log_every_s is None else Progress(len(prompts), every_s=self.log_every_s, name="conversation")
        )
        for start in range(0, len(prompts), self.batch_size):
            batch = prompts[start : start + self.batch_size]
            width = 1 << max(len(p) for p in batch).bit_length()  # few shapes, few compiles
            tokens = np.zeros((self.batch_size, width), np.int32)
            lengths = np.ones(self.batch_size, np.int32)
            for row, ids in enumerate(batch):
                tokens[row, : len(ids)], lengths[row] = ids, len(ids)
            out.append(
                np.asarray(
                    _last_logits(self.model.params, tokens, lengths, jnp.asarray(self.label_ids), self.model.cfg)
                )[: len(batch)]
            )
            if progress:
                progress.update(start + len(batch))
        return np.concatenate(out) if out else np.zeros((0, len(self.labels)), np.float32)

    def route(
        self, conversations: Sequence[Sequence[Message]], offsets: np.ndarray | None = None
    ) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Per conversation, the adapter index that serves it (NO_ADAPTER or a capability's position in
        `options`) and the softmax weights over the labels; and the offsets subtracted from the label logits:
        `offsets` where given (a server routes one conversation at a time with those its run stored), else the
        calibration's over these conversations, routed together."""
        logits = self.logits(conversations)
        offsets = calibration_offsets(logits, self.calibration) if offsets is None else np.asarray(offsets)
        logits = logits - offsets
        weights = np.exp(logits - logits.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        return [NO_ADAPTER if i == 0 else int(i) - 1 for i in logits.argmax(axis=1)], weights, offsets
