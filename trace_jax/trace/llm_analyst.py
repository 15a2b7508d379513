"""The LLM analyst of stage 1: an OpenAI-compatible model proposes capabilities and labels trajectories.

Discovery shows successful and failed trajectories (compacted, failed and successful ones
taking turns, as many as fit a token budget) and asks for a dictionary of general
capabilities as JSON. Labelling shows the dictionary and a batch of trajectories and asks for
NA / PRESENT / LACKING with evidence for every (capability, trajectory) pair; a reply that is
not a partition of the batch's ids is sent back with the error (see `ChatClient.complete_json`),
and a labelling whose batch never comes right is dropped (`LabellingFailed`) and counted.
Labelling `attempt` is sampled with `sample=attempt`, so the N runs are independent samples.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from trace_jax.llm.client import ChatClient, MalformedReply
from trace_jax.trace.analyst import LABELS, CapabilityCard, Label, Labelling, LabellingFailed
from trace_jax.trace.trajectories import ScoredTrajectory, compact

CHARS_PER_TOKEN = 4  # a budget in tokens, counted in characters (English and JSON run about 4 per token)
_NAME = re.compile(r"^[a-z][a-z0-9_]{1,48}$")

SYSTEM = (
    "You are an expert analyst of LLM agents. You read agent trajectories and explain failures by the "
    "capabilities the agent lacks. You answer with JSON only."
)

DISCOVERY = """Below are {shown_passed} successful and {shown_failed} failed trajectories \
(of {passed} and {failed} in all) of one agent in one environment, one JSON object per line: reward and its \
components, why the episode failed, and its messages (long contents cut, tool calls written name(args)).

Propose at most {max_candidates} general capabilities whose absence explains the failures: behaviours that \
successful solutions need and failed ones lack. For each give "name" (short snake_case), "description" (two or \
three sentences, precise enough for another analyst to tell PRESENT from LACKING) and "lacking" (what a \
trajectory lacking it looks like). Keep them general: no task ids, amounts or procedures in names or descriptions.

Reply with JSON only: {{"capabilities": [{{"name": "...", "description": "...", "lacking": "..."}}]}}

Trajectories:
{trajectories}"""

LABELLING = """Capabilities:
{capabilities}

For every trajectory below and every capability, give one label: "NA" (the task does not need the capability), \
"PRESENT" (needed and exercised correctly) or "LACKING" (needed and missing or done wrong), with one sentence of \
evidence. A failure where the capability was exercised correctly but something else went wrong is PRESENT; when \
unsure on a failure, PRESENT.

Reply with JSON only: {{"labels": {{"<capability>": {{"<trajectory id>": {{"label": "...", "evidence": "..."}}}}}}}} \
with every capability ({names}) and, under each, exactly these trajectory ids: {ids}

Trajectories:
{trajectories}"""


def _lines(views: Sequence[dict]) -> str:
    return "\n".join(json.dumps(view, ensure_ascii=False) for view in views)


def _cards(value) -> list[CapabilityCard]:
    """A discovery reply's dictionary, or ValueError saying what is wrong with it."""
    if not isinstance(value, dict) or not isinstance(value.get("capabilities"), list) or not value["capabilities"]:
        raise ValueError('expected {"capabilities": [...]} with at least one capability')
    cards = []
    for item in value["capabilities"]:
        if not isinstance(item, dict) or not all(
            isinstance(item.get(k), str) and item[k].strip() for k in ("name", "description", "lacking")
        ):
            raise ValueError(f'each capability needs non-empty "name", "description" and "lacking"; got {item!r:.200}')
        if not _NAME.match(item["name"]):
            raise ValueError(f"capability name {item['name']!r} is not short snake_case")
        cards.append(CapabilityCard(item["name"], item["description"].strip(), item["lacking"].strip()))
    names = [c.name for c in cards]
    if len(set(names)) != len(names):
        raise ValueError(f"capability names repeat: {names}")
    return cards


class LLMAnalyst:
    """Stage 1's analyst as prompts to an OpenAI-compatible chat model (see the module docstring)."""

    deterministic = False

    def __init__(
        self,
        client: ChatClient,
        *,
        discovery_tokens: int = 12000,
        message_chars: int = 300,
        max_candidates: int = 10,
        label_batch: int = 10,
    ):
        self.client = client
        self.discovery_tokens, self.message_chars = discovery_tokens, message_chars
        self.max_candidates, self.label_batch = max_candidates, label_batch

    def _shown(self, trajectories: Sequence[ScoredTrajectory]) -> list[dict]:
        """Failed and successful trajectories in turns, as many as fit the discovery budget."""
        failed = [t for t in trajectories if not t.success]
        passed = [t for t in trajectories if t.success]
        turns = [t for pair in zip(failed, passed) for t in pair] + failed[len(passed) :] + passed[len(failed) :]
        shown, used = [], 0
        for trajectory in turns:
            view = compact(trajectory, self.message_chars)
            size = len(json.dumps(view, ensure_ascii=False)) + 1
            if used + size > self.discovery_tokens * CHARS_PER_TOKEN:
                break
            shown.append(view)
            used += size
        if not shown:
            raise ValueError(f"analysis.discovery_tokens = {self.discovery_tokens} fits no trajectory")
        return shown

    def discover(self, trajectories: Sequence[ScoredTrajectory]) -> list[CapabilityCard]:
        shown = self._shown(trajectories)
        prompt = DISCOVERY.format(
            shown_passed=sum(v["reward"] >= 1.0 for v in shown),
            shown_failed=sum(v["reward"] < 1.0 for v in shown),
            passed=sum(t.success for t in trajectories),
            failed=sum(not t.success for t in trajectories),
            max_candidates=self.max_candidates,
            trajectories=_lines(shown),
        )

        def validate(value) -> list[CapabilityCard]:
            cards = _cards(value)
            if len(cards) > self.max_candidates:
                raise ValueError(f"{len(cards)} capabilities; at most {self.max_candidates} were asked for")
            return cards

        try:
            return self.client.complete_json(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}], validate
            )
        except MalformedReply as error:
            raise RuntimeError(f"capability discovery failed: {error}") from error

    def label(
        self, trajectories: Sequence[ScoredTrajectory], cards: Sequence[CapabilityCard], attempt: int
    ) -> Labelling:
        labelling: dict[str, dict[str, Label]] = {card.name: {} for card in cards}
        for start in range(0, len(trajectories), self.label_batch):
            batch = trajectories[start : start + self.label_batch]
            try:
                labels = self._label_batch(batch, cards, attempt)
            except MalformedReply as error:
                raise LabellingFailed(f"trajectories {start}-{start + len(batch) - 1}: {error}") from error
            for name, by_id in labels.items():
                labelling[name].update(by_id)
        return labelling

    def _label_batch(
        self, batch: Sequence[ScoredTrajectory], cards: Sequence[CapabilityCard], attempt: int
    ) -> dict[str, dict[str, Label]]:
        ids = [t.id for t in batch]
        names = [card.name for card in cards]
        prompt = LABELLING.format(
            capabilities="\n".join(f"- {c.name}: {c.description} LACKING looks like: {c.lacking}" for c in cards),
            names=", ".join(names),
            ids=json.dumps(ids),
            trajectories=_lines([compact(t, self.message_chars) for t in batch]),
        )

        def validate(value) -> dict[str, dict[str, Label]]:
            labels = value.get("labels") if isinstance(value, dict) else None
            if not isinstance(labels, dict) or set(labels) != set(names):
                raise ValueError(f'expected {{"labels": {{...}}}} with exactly the capabilities {names}')
            parsed = {}
            for name in names:
                by_id = labels[name]
                if not isinstance(by_id, dict) or set(by_id) != set(ids):
                    got = sorted(by_id) if isinstance(by_id, dict) else by_id
                    raise ValueError(f"{name}: the ids must be exactly {ids} (a partition of the batch); got {got}")
                parsed[name] = {}
                for tid, item in by_id.items():
                    label = item.get("label") if isinstance(item, dict) else item
                    if label not in LABELS:
                        raise ValueError(f"{name} / {tid}: label {label!r} is not one of {list(LABELS)}")
                    evidence = item.get("evidence", "") if isinstance(item, dict) else ""
                    parsed[name][tid] = Label(label, str(evidence))
            return parsed

        return self.client.complete_json(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}], validate, sample=attempt
        )
