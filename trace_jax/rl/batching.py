"""Turns scored rollouts (prompt tokens, sampled completion tokens and logprobs) into a learner batch.

Rows are padded to a bucketed length (few distinct shapes, so few recompiles) and the
row count to a multiple the learner needs (micro-batches x data-parallel devices).
When every prompt starts with the same long prefix (system prompt, tool schemas,
demonstrations) that prefix is cut off once and run once per adapter by the learner
(see `learner.token_logprobs`), which is exact and much cheaper than repeating it per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trace_jax.sampling import bucket_size, prefix_capacity, shared_prefix_length


def build_learner_batch(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    completion_logprobs: Sequence[Sequence[float]],
    advantages: Sequence[float],
    adapter_idx: Sequence[int],
    *,
    num_rows: int | None = None,
    row_multiple: int = 1,
    completion_budget: int = 0,
    min_width: int = 0,
    min_shared_prefix: int | None = 64,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """The `make_train_step` batch for rows prompt[i] + completion[i].

    The loss covers exactly the completion tokens; their sampling logprobs are the old
    policy's (`old_logp`). Padding rows (up to `num_rows`, which keeps the learner's
    shapes and so its compiled program the same from step to step, then up to a multiple
    of `row_multiple`) have an empty loss mask: they change neither the loss nor its
    denominator. The row length is bucketed from the longest prompt tail plus at least
    `completion_budget` tokens (pass max_new_tokens), and is at least `min_width` (pass
    the last batch's width): the learner's shapes, and so its compiled program, then stay
    the same from step to step. The shared prefix is padded to a multiple of 64 tokens
    (`prefix_capacity`).
    """
    n = len(prompts)
    if not n == len(completions) == len(completion_logprobs) == len(advantages) == len(adapter_idx):
        raise ValueError("prompts, completions, completion_logprobs, advantages and adapter_idx differ in length")
    if any(len(c) != len(lp) for c, lp in zip(completions, completion_logprobs)):
        raise ValueError("each completion needs one logprob per token")
    cut = shared_prefix_length(prompts, min_shared_prefix)
    if num_rows is not None and num_rows < n:
        raise ValueError(f"{n} rows do not fit num_rows={num_rows}")
    rows = -(-max(n, num_rows or 0) // row_multiple) * row_multiple
    longest = max(len(p) - cut + max(len(c), completion_budget) for p, c in zip(prompts, completions))
    width = bucket_size(max(longest, min_width), 16)
    tokens = np.full((rows, width), pad_id, np.int32)
    loss_mask = np.zeros((rows, width - 1), np.float32)
    old_logp = np.zeros((rows, width - 1), np.float32)
    for i, (prompt, completion, logp) in enumerate(zip(prompts, completions, completion_logprobs)):
        row = list(prompt[cut:]) + list(completion)
        tokens[i, : len(row)] = row
        first = len(prompt) - cut - 1  # logprob index of the first completion token
        loss_mask[i, first : first + len(completion)] = 1.0
        old_logp[i, first : first + len(completion)] = logp
    row_adapter = np.zeros((rows,), np.int32)
    row_adapter[:n] = adapter_idx
    row_adapter[n:] = row_adapter[0]
    batch = {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "old_logp": old_logp,
        "advantages": np.pad(np.asarray(advantages, np.float32), (0, rows - n)),
        "adapter_idx": row_adapter,
    }
    if cut:
        groups, prefix_of_row = np.unique(row_adapter, return_inverse=True)
        prefix = np.full((prefix_capacity(cut),), pad_id, np.int32)
        prefix[:cut] = prompts[0][:cut]
        batch["prefix_tokens"] = np.tile(prefix, (len(groups), 1))
        batch["prefix_lengths"] = np.full((len(groups),), cut, np.int32)
        batch["prefix_adapter"] = groups.astype(np.int32)
        batch["prefix_of_row"] = prefix_of_row.reshape(-1).astype(np.int32)
    return batch
