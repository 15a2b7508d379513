"""Learner batches from sampled sequences: single-turn completions and multi-turn trajectories alike.

A `LearnerSequence` is what the model saw, token for token (the prompt, every sampled turn
as sampled, every observation as encoded), with a loss mask on the tokens to learn (the
sampled ones), the sampler's logprob of each, and the sequence's advantage and adapter.
`pack_sequences` cuts the head all sequences share (system prompt, policy, tool schemas)
off once, to be run once per adapter by the learner (see `learner.token_logprobs`), and
packs the rows into micro-batches by a token budget: rows sorted by length, each
micro-batch as wide as its longest row rounded up to a bucket and as many rows as the
budget holds at that width. A micro-batch's shape is a function of its width bucket
alone, so a run compiles one learner program per bucket it meets and never another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from trace_jax.rl.learner_batch import LearnerBatch, MicroBatch, SharedPrefix
from trace_jax.sampling import bucket_size, prefix_capacity, shared_prefix_length

MIN_WIDTH = 16  # the narrowest row bucket


@dataclasses.dataclass(frozen=True)
class LearnerSequence:
    """One sampled sequence as the learner sees it (all lists aligned with `tokens`).

    loss_mask[t] = 1 marks tokens[t] as sampled (learned); logprobs[t] is its sampling
    logprob (anything where the mask is 0). `hinted`: sampled with a hint in its context that
    `tokens` lack, so `logprobs` are not the policy's on `tokens` and the learner recomputes
    those (`learner.make_rescore_fn`).
    """

    tokens: Sequence[int]
    loss_mask: Sequence[int]
    logprobs: Sequence[float]
    advantage: float = 0.0
    adapter_idx: int = 0
    hinted: bool = False

    def __post_init__(self):
        if not len(self.tokens) == len(self.loss_mask) == len(self.logprobs):
            raise ValueError(
                f"tokens ({len(self.tokens)}), loss_mask ({len(self.loss_mask)}) and logprobs "
                f"({len(self.logprobs)}) differ in length"
            )
        if self.loss_mask and self.loss_mask[0]:
            raise ValueError("the first token cannot be learned: nothing precedes it")

    @classmethod
    def completion(
        cls,
        prompt: Sequence[int],
        completion: Sequence[int],
        logprobs: Sequence[float],
        advantage: float = 0.0,
        adapter_idx: int = 0,
    ) -> LearnerSequence:
        """A prompt followed by one sampled completion (single-turn tasks)."""
        if len(completion) != len(logprobs):
            raise ValueError("each completion token needs one logprob")
        return cls(
            list(prompt) + list(completion),
            [0] * len(prompt) + [1] * len(completion),
            [0.0] * len(prompt) + list(logprobs),
            advantage,
            adapter_idx,
        )

    def first_learned(self) -> int:
        """Index of the first loss token (len(tokens) when there is none)."""
        return next((i for i, m in enumerate(self.loss_mask) if m), len(self.tokens))

    def last_learned(self) -> int:
        """Index of the last loss token (-1 when there is none)."""
        return max((i for i, m in enumerate(self.loss_mask) if m), default=-1)


@dataclasses.dataclass(frozen=True)
class StepRollouts:
    """One GRPO step's rollouts: learner sequences (advantages not yet set), rewards, the group
    (task) of each, their metrics ("rollout/...") and, for episodes, each one's record (messages,
    reward components, end reason) for the step's log."""

    sequences: list[LearnerSequence]
    rewards: np.ndarray
    group_ids: np.ndarray
    metrics: dict[str, float]
    records: list[dict] = dataclasses.field(default_factory=list)


def micro_batch_rows(width: int, token_budget: int, row_multiple: int = 1) -> int:
    """Rows of a micro-batch of `width` tokens per row: as many as `token_budget` holds, a multiple
    of `row_multiple` (the mesh's data-parallel size), at least one multiple."""
    return max(row_multiple, (token_budget // width) // row_multiple * row_multiple)


def pack_sequences(
    sequences: Sequence[LearnerSequence],
    *,
    token_budget: int,
    row_multiple: int = 1,
    min_shared_prefix: int | None = 64,
    pad_id: int = 0,
    prefix_length: int | None = None,
) -> LearnerBatch:
    """The learner batch of `sequences`: micro-batches and the head they share.

    Row entries per micro-batch: tokens [R, W]; loss_positions [R, K], the entries of tokens[:, 1:]
    that are learned (the learner projects only those onto the vocabulary; K is the row's
    largest count rounded up to a bucket, at most W - 1); loss_mask / old_logp [R, K] aligned
    with them; advantages [R], adapter_idx [R], sequence [R] (the index of each row's sequence in
    `sequences`, -1 for padding) and, with a shared prefix, prefix_of_row [R].
    `prefix_length` fixes where the shared prefix is cut (a job that keeps per-position data of
    the same sequences across steps wants the same cut every step); by default the longest
    head all sequences share, if at least `min_shared_prefix` tokens.
    Padding rows and entries have an empty mask: they change neither the loss nor its denominators.
    Sequences with no loss token are left out. Tokens after a sequence's last loss token are
    not run (they predict nothing learned).
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    kept = [i for i, s in enumerate(sequences) if s.last_learned() >= 0]
    learned = [sequences[i] for i in kept]
    if not learned:
        raise ValueError("no sequence has a loss token")
    # Each row keeps at least the token before its first loss token (its position predicts it).
    heads = [s.tokens[: s.first_learned()] for s in learned]
    if prefix_length is None:
        cut = shared_prefix_length(heads, min_shared_prefix)
    elif any(len(h) <= prefix_length or list(h[:prefix_length]) != list(heads[0][:prefix_length]) for h in heads):
        raise ValueError(
            f"the sequences do not all share a head of prefix_length {prefix_length} tokens before "
            "their first loss token"
        )
    else:
        cut = prefix_length
    adapters = sorted({s.adapter_idx for s in learned})
    lengths = [s.last_learned() + 1 - cut for s in learned]
    order = sorted(range(len(learned)), key=lambda i: (-lengths[i], i))
    micro_batches = []
    at = 0
    while at < len(order):
        width = bucket_size(lengths[order[at]], MIN_WIDTH)
        rows = micro_batch_rows(width, token_budget, row_multiple)
        chosen = order[at : at + rows]
        micro_batches.append(
            _rows([learned[i] for i in chosen], [kept[i] for i in chosen], rows, width, cut, adapters, pad_id)
        )
        at += rows
    if not cut:
        return LearnerBatch(tuple(micro_batches))
    head = np.full((prefix_capacity(cut),), pad_id, np.int32)
    head[:cut] = learned[0].tokens[:cut]
    prefix = SharedPrefix(
        tokens=np.tile(head, (len(adapters), 1)),
        lengths=np.full((len(adapters),), cut, np.int32),
        adapter=np.asarray(adapters, np.int32),
    )
    return LearnerBatch(tuple(micro_batches), prefix=prefix)


def _rows(
    sequences: list[LearnerSequence],
    indices: list[int],
    rows: int,
    width: int,
    cut: int,
    adapters: list[int],
    pad_id: int,
) -> MicroBatch:
    """One micro-batch of `rows` x `width`: the sequences after the shared prefix, then padding rows."""
    learned = [np.flatnonzero(s.loss_mask[cut + 1 : s.last_learned() + 1]) for s in sequences]
    scored = min(bucket_size(max(len(at) for at in learned), MIN_WIDTH), width - 1)
    tokens = np.full((rows, width), pad_id, np.int32)
    positions = np.zeros((rows, scored), np.int32)
    loss_mask = np.zeros((rows, scored), np.float32)
    old_logp = np.zeros((rows, scored), np.float32)
    advantages = np.zeros((rows,), np.float32)
    adapter_idx = np.full((rows,), sequences[0].adapter_idx, np.int32)
    for i, (s, at) in enumerate(zip(sequences, learned)):
        end = s.last_learned() + 1
        tokens[i, : end - cut] = s.tokens[cut:end]
        positions[i, : len(at)] = at
        loss_mask[i, : len(at)] = 1.0
        old_logp[i, : len(at)] = np.asarray(s.logprobs, np.float32)[cut + 1 + at]
        advantages[i] = s.advantage
        adapter_idx[i] = s.adapter_idx
    sequence = np.full((rows,), -1, np.int32)
    sequence[: len(indices)] = indices
    return MicroBatch(
        tokens=tokens,
        adapter_idx=adapter_idx,
        loss_mask=loss_mask,
        advantages=advantages,
        old_logp=old_logp,
        loss_positions=positions,
        prefix_of_row=np.searchsorted(adapters, adapter_idx).astype(np.int32) if cut else None,
        sequence=sequence,
    )


def learned_tokens(batch: LearnerBatch) -> int:
    """How many loss tokens a packed batch holds."""
    return int(sum(mb.loss_mask.sum() for mb in batch.micro_batches))


def padded_tokens(batch: LearnerBatch) -> int:
    """How many token positions a packed batch runs (padding included; the shared prefix not)."""
    return int(sum(mb.tokens.size for mb in batch.micro_batches))
