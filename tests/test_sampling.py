"""KV-cache generation: cache equals a full forward, continuation, per-row settings, stops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from trace_jax import lora
from trace_jax.models.config import ModelConfig
from trace_jax.models.decoder import forward, init_cache
from trace_jax.models.loading import load_params
from trace_jax.runtime import ProgramLog
from trace_jax.sampling import (
    FINISH_CONTEXT,
    FINISH_LENGTH,
    FINISH_STOP,
    Sampler,
    common_prefix_length,
    sample_from_logits,
    shared_prefix_length,
    truncate_logits,
)
from trace_jax.sharding import ShardingPlan, make_mesh


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    path, torch_model = tiny_checkpoints["qwen3"]
    cfg = ModelConfig.from_dir(path)
    return cfg, load_params(path, cfg), torch_model


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def each_family(request, tiny_checkpoints):
    """The model of each attention kind: global only (Qwen3), and Gemma 3's local sliding-window layer (a window
    of 5, far shorter than the prompts and prefixes here) beside a global one."""
    path, torch_model = tiny_checkpoints[request.param]
    cfg = ModelConfig.from_dir(path)
    return cfg, load_params(path, cfg), torch_model


def _full_logprobs(params, cfg, prompt, generated):
    logits, _ = forward(params, jnp.asarray([prompt + generated]), cfg)
    logp = jax.nn.log_softmax(logits[0, len(prompt) - 1 : -1], axis=-1)
    return np.asarray(logp[jnp.arange(len(generated)), jnp.asarray(generated)])


def test_cached_decoding_equals_full_forward(each_family):
    cfg, params, _ = each_family
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (3, 24))
    full, _ = forward(params, jnp.asarray(tokens), cfg)
    cache = init_cache(cfg, 3, 64)
    cached_forward = jax.jit(lambda p, t, c, n: forward(p, t, cfg, cache=c, num_new=n))
    # Prefill rows with different lengths, then feed the rest one token at a time.
    starts = np.array([5, 11, 17])
    prompt = np.zeros((3, 17), np.int32)
    for b, s in enumerate(starts):
        prompt[b, :s] = tokens[b, :s]
    logits, cache = cached_forward(params, jnp.asarray(prompt), cache, jnp.asarray(starts))
    for b, s in enumerate(starts):
        assert np.abs(np.asarray(logits[b, s - 1]) - np.asarray(full[b, s - 1])).max() <= 1e-5
    for b in range(3):
        for t in range(starts[b], 24):
            step = np.zeros((3, 1), np.int32)
            step[b, 0] = tokens[b, t]
            num_new = jnp.asarray(np.eye(3, dtype=np.int32)[b])
            logits, cache = cached_forward(params, jnp.asarray(step), cache, num_new)
            assert np.abs(np.asarray(logits[b, 0]) - np.asarray(full[b, t])).max() <= 1e-5
    assert np.asarray(cache.lengths).tolist() == [24, 24, 24]


def test_greedy_matches_transformers_generate_and_logprobs_rescore(each_family):
    cfg, params, torch_model = each_family
    sampler = Sampler(cfg, params)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 20]
    outs, _ = sampler.generate(prompts, key=jax.random.key(0), max_new_tokens=12)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch_model.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0].tolist()
        assert prompt + out.token_ids == ref and out.finish_reason == FINISH_LENGTH
        assert np.abs(_full_logprobs(params, cfg, prompt, out.token_ids) - np.array(out.logprobs)).max() <= 1e-4


def test_continuing_a_row_equals_a_fresh_prefill(model):
    cfg, params, _ = model
    sampler = Sampler(cfg, params)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [11]]
    first, cache = sampler.generate(prompts, key=jax.random.key(0), max_new_tokens=6)
    turn2 = [[20, 21], [22]]
    cont, cache = sampler.generate(
        turn2, key=jax.random.key(5), max_new_tokens=7, cache=cache, rows=[2, 0], temperature=1.0
    )
    for row, extra, out in zip([2, 0], turn2, cont):
        history = prompts[row] + first[row].token_ids + extra
        fresh, _ = sampler.generate([history], key=jax.random.key(5), max_new_tokens=7, temperature=1.0)
        assert np.abs(_full_logprobs(params, cfg, history, out.token_ids) - np.array(out.logprobs)).max() <= 1e-4
        assert len(fresh[0].token_ids) == 7
    assert np.asarray(cache.lengths)[[0, 1, 2]].tolist() == [3 + 6 + 1 + 7, 6 + 6, 1 + 6 + 2 + 7]
    greedy_cont, _ = sampler.generate([[30]], key=jax.random.key(0), max_new_tokens=5, cache=cache, rows=[1])
    history = prompts[1] + first[1].token_ids + [30]
    greedy_fresh, _ = sampler.generate([history], key=jax.random.key(0), max_new_tokens=5)
    assert greedy_cont[0].token_ids == greedy_fresh[0].token_ids


def test_a_row_started_from_a_stored_prefix_equals_a_full_prefill(each_family):
    """start_row points a used row at the first `length` positions of a prefix slot; the row
    then continues exactly as if its whole prompt had been prefilled there, and the other
    rows are untouched."""
    cfg, params, _ = each_family
    sampler = Sampler(cfg, params, min_shared_prefix=None)
    rng = np.random.RandomState(3)
    head = rng.randint(0, cfg.vocab_size, 150).tolist()
    _, cache = sampler.generate([[1, 2, 3], [4, 5]], key=jax.random.key(0), max_new_tokens=4)
    cache, slot = sampler.add_prefix(cache, [9] * 40, lora.NO_ADAPTER)
    cache, slot = sampler.add_prefix(cache, head + [7, 7], lora.NO_ADAPTER)  # stored from another prompt: shares 150
    assert slot == 1 and cache.num_slots == 2
    prompt = head + rng.randint(0, cfg.vocab_size, 9).tolist()
    cache = sampler.start_row(cache, 1, slot, 150)
    assert int(cache.lengths[1]) == 0 and int(cache.prefix_len[1]) == 150 and int(cache.lengths[0]) == 3 + 4
    out, cache = sampler.generate(
        [prompt[150:]], key=jax.random.key(1), max_new_tokens=6, temperature=1.0, cache=cache, rows=[1]
    )
    assert np.abs(_full_logprobs(params, cfg, prompt, out[0].token_ids) - np.array(out[0].logprobs)).max() <= 1e-4
    assert int(cache.lengths[1]) == len(prompt) - 150 + 6
    emptied = sampler.start_row(cache, 1)
    assert int(emptied.lengths[1]) == 0 and int(emptied.prefix_len[1]) == 0


def test_row_prefills_are_grouped_to_compute_the_fewest_rows(model):
    """Rows fed together are prefilled in calls whose padded widths (1, 4, 16, ...) sum to no more than one call's
    (a call counting as half a row), largest first."""
    cfg, params, _ = model
    sampler = Sampler(cfg, params)
    for n in range(1, 65):
        groups = sampler.shapes.row_groups(n, 64)
        assert sum(groups) == n and groups == sorted(groups, reverse=True)
        assert sum(sampler.shapes.rows_width(k, 64) + 0.5 for k in groups) <= sampler.shapes.rows_width(n, 64) + 0.5
    assert sampler.shapes.row_groups(6, 64) == [4, 1, 1] and sampler.shapes.row_groups(16, 64) == [16]


def test_a_session_feeds_rows_while_others_sample(model):
    """Rows fed at different times (one joins mid-way through another's turn, one is fed its next
    turn as soon as its first ends) each sample what they would alone: the greedy tokens of a
    fresh `generate` of their whole history, and a full forward pass's logprobs. With
    return_early a step ends at the first finished row. Prompts longer than prefill_chunk are
    prefilled in several calls. The cache grows as rows need room and shrinks when the longest
    row is released."""
    cfg, params, _ = model
    sampler = Sampler(cfg, params, decode_chunk=4, min_cache=32, prefill_chunk=16)
    session = sampler.session(4)
    history = {0: [1, 2, 3], 1: list(range(6, 43)), 2: [4, 5]}
    session.feed([0], [history[0]], max_new_tokens=10)
    assert session.step(jax.random.key(0)) == {}  # a chunk of 4 tokens: row 0 still sampling
    session.feed([2, 1], [history[2], history[1]], max_new_tokens=[3, 6])
    outputs, key = [], 1
    while session.running:
        done = session.step(jax.random.key(key), return_early=True)
        key += 1
        assert len(done) <= 2 and all(isinstance(row, int) for row in done)
        for row, out in done.items():
            outputs.append((row, list(history[row]), out))
            history[row] = history[row] + out.token_ids
            if row == 2 and len(outputs) == 1:  # row 2 ends first (3 tokens): feed it its next turn at once
                history[2] = history[2] + [10, 11]
                session.feed([2], [[10, 11]], max_new_tokens=5)
    assert [row for row, _, _ in outputs][:1] == [2] and len(outputs) == 4
    for _, prompt, out in outputs:
        alone, _ = sampler.generate([prompt], key=jax.random.key(0), max_new_tokens=len(out.token_ids))
        assert out.token_ids == alone[0].token_ids and out.finish_reason == FINISH_LENGTH
        assert np.abs(_full_logprobs(params, cfg, prompt, out.token_ids) - np.array(out.logprobs)).max() <= 1e-4
    # rows 2 and 1 fed together are prefilled apart (two calls of one row compute fewer rows than one of four:
    # `ShapePolicy.row_groups`), row 1's 37 tokens in three calls
    assert session.stats["prefill_calls"] == 1 + 1 + 3 + 1
    with pytest.raises(ValueError, match="distinct rows"):
        session.feed([5], [[1]])
    # Releasing the longest row (43 tokens) shrinks the cache to what the others hold; they go on exactly.
    grown = session.cache.max_len
    session.release([1])
    assert session.cache.max_len < grown and np.asarray(session.cache.lengths)[1] == 0
    session.feed([0], [[12, 13]], max_new_tokens=4)
    ((row, out),) = session.step(jax.random.key(9)).items()
    alone, _ = sampler.generate([history[0] + [12, 13]], key=jax.random.key(0), max_new_tokens=4)
    assert row == 0 and out.token_ids == alone[0].token_ids


def test_a_session_sums_the_positions_of_the_tokens_it_prefills(model):
    """`stats["prefill_positions"]` is the sum of the positions in their conversations of the tokens a session
    prefilled: a stored prefix once, then each row's own tokens after the prefix it continues and the tokens it
    generated; an opening copied from a row holding it is not prefilled. (The rollout benchmark prices its ideal
    prefill at their mean.)"""
    cfg, params, _ = model
    sampler = Sampler(cfg, params, min_shared_prefix=8, prefill_chunk=16)
    session = sampler.session(4)
    head = list(range(1, 21))
    assert [session.start(r, head + [30 + r]) for r in (0, 1)] == [20, 20]  # one prefix: head, 20 tokens
    session.feed([0, 1], [[30], [31, 32, 33]], max_new_tokens=3)
    while session.running:
        session.step(jax.random.key(0))
    session.feed([0], [[40] * 18], max_new_tokens=1)  # after 20 + 1 + 3 positions, in two chunks
    expected = sum(range(20)) + 20 + sum(range(20, 23)) + sum(range(24, 42))
    assert session.stats["prefill_positions"] == expected
    assert session.stats["prefix_tokens"] + session.stats["prefill_tokens"] == 20 + 1 + 3 + 18
    assert session.start(2, head + [30]) == 20 and session.feed([2], [[30]], max_new_tokens=1) is None
    assert session.stats["copied_rows"] == 1 and session.stats["prefill_positions"] == expected  # row 0's copied


def test_rows_that_open_alike_are_prefilled_once_and_copied(model):
    """A GRPO group's episodes open with the same tokens: one row is prefilled, the others copy it, and
    each then samples on its own (greedy: as if prefilled alone; logprobs rescore on a full forward)."""
    cfg, params, _ = model
    sampler = Sampler(cfg, params, min_shared_prefix=None)
    p, q = [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]
    session = sampler.session(8)
    session.feed([0, 1, 2, 3, 5], [p, q, p, p, q], max_new_tokens=6)
    assert session.stats["copied_rows"] == 3 and session.stats["prefill_rows"] == 2
    done = {}
    while session.running:
        done.update(session.step(jax.random.key(0)))
    alone, _ = sampler.generate([p, q], key=jax.random.key(0), max_new_tokens=6)
    for row, prompt, out in zip((0, 1, 2, 3, 5), (p, q, p, p, q), (alone[0], alone[1], alone[0], alone[0], alone[1])):
        assert done[row].token_ids == out.token_ids
        assert (
            np.abs(_full_logprobs(params, cfg, prompt, done[row].token_ids) - np.array(done[row].logprobs)).max()
            <= 1e-4
        )
    sampled, _ = sampler.generate([p] * 4, key=jax.random.key(1), max_new_tokens=8, temperature=1.0)
    assert len({tuple(o.token_ids) for o in sampled}) > 1  # copies draw their own tokens


def test_a_row_opening_as_a_held_row_copies_it_later(model):
    """A row fed later with an opening another row holds (that row has gone on sampling since) copies it: the
    opening's length and the logits after it, not the holder's; rows restarted, released or cut below it
    no longer hold it, and with no holder left the opening is prefilled again."""
    cfg, params, _ = model
    sampler = Sampler(cfg, params, min_shared_prefix=None)
    p = [3, 1, 4, 1, 5, 9, 2, 6]
    alone, _ = sampler.generate([p], key=jax.random.key(0), max_new_tokens=6)
    session = sampler.session(8)

    def play(row: int) -> list[int]:
        session.feed([row], [p], max_new_tokens=6)
        done = {}
        while session.running:
            done.update(session.step(jax.random.key(0)))
        assert done[row].token_ids == alone[0].token_ids
        assert np.abs(_full_logprobs(params, cfg, p, done[row].token_ids) - np.array(done[row].logprobs)).max() <= 1e-4
        return [session.stats[name] for name in ("prefill_rows", "copied_rows", "copied_tokens")]

    assert play(0) == [1, 0, 0]
    assert play(3) == [1, 1, len(p)]  # row 0 holds p and 6 sampled tokens after it
    session.release([0])
    assert play(5) == [1, 2, 2 * len(p)]  # row 3 still holds it
    session.start(3, [7])
    session.feed([3], [[8] * len(p)], max_new_tokens=1)  # row 3 now holds other tokens where p was
    while session.running:
        session.step(jax.random.key(0))
    assert session.keep(5, len(p) - 1)  # cut inside the opening: row 5 holds it no more
    assert play(6) == [3, 2, 2 * len(p)]


def test_a_session_compiles_few_programs_whatever_it_is_fed(model):
    """Feeds of any number of rows and any piece lengths compile one row prefill per (width: 1, 4 or
    16 rows; length: a power of two from 32 to the chunk; window: the fed rows' reach, a power of two up to
    the cache length) and one decode per cache length, with cache lengths powers of two: the programs of a
    long run stay few (each maps hundreds of kernels into memory, and a process has a limit on maps)."""
    cfg, params, _ = model
    sampler = Sampler(cfg, params, decode_chunk=4, min_cache=32, prefill_chunk=64)
    session, rng, capacities = sampler.session(16), np.random.default_rng(0), set()
    programs = lambda name: getattr(sampler.programs, name)._cache_size()  # shared by the samplers of one model
    before = {name: programs(name) for name in ("prefill_rows", "take_rows", "decode")}
    for _ in range(10):
        rows = rng.choice(16, size=int(rng.integers(1, 17)), replace=False)
        session.feed(
            rows,
            [rng.integers(1, 100, size=int(rng.integers(1, 90))).tolist() for _ in rows],
            max_new_tokens=int(rng.integers(1, 9)),
        )
        capacities.add(session.cache.max_len)
        while session.running:
            session.step(jax.random.key(0))
            capacities.add(session.cache.max_len)
    assert all(c & (c - 1) == 0 for c in capacities), capacities
    windows = [w for w in (32, 64, 128, 256) if w <= max(capacities)]
    assert programs("prefill_rows") - before["prefill_rows"] <= 3 * 2 * len(windows)
    assert programs("take_rows") - before["take_rows"] <= 3 * len(windows) * len(capacities)
    assert programs("decode") - before["decode"] <= len(capacities)


def test_samplers_of_one_model_share_their_compiled_programs(model):
    """A job builds a sampler per evaluation (each calibration try, each adapter's evaluation): the second one
    compiles nothing, where kernels jitted anew would compile some programs again and hold both copies."""
    cfg, params, _ = model
    prompts, outputs, compiled = [[1, 2, 3, 4, 5], [6, 7, 8]], [], []
    for _ in range(2):
        with ProgramLog() as programs:
            sampler = Sampler(cfg, params, decode_chunk=3)
            outputs.append(sampler.generate(prompts, max_new_tokens=7, key=jax.random.key(0))[0])
        compiled.append(programs.built)
    assert compiled[0] > 0 and compiled[1] == 0, compiled
    assert [o.token_ids for o in outputs[0]] == [o.token_ids for o in outputs[1]]


def test_sampling_parameters_do_not_recompile_and_key_decides(model):
    cfg, params, _ = model
    sampler = Sampler(cfg, params)
    kwargs = dict(max_new_tokens=20)
    a, _ = sampler.generate(
        [[1, 2]] * 3,
        key=jax.random.key(1),
        temperature=[1.0, 0.7, 0.0],
        top_p=[1.0, 0.9, 1.0],
        top_k=[0, 0, 5],
        **kwargs,
    )
    compiled = sampler.programs.decode._cache_size()
    b, _ = sampler.generate(
        [[1, 2]] * 3,
        key=jax.random.key(1),
        temperature=[1.0, 0.7, 0.0],
        top_p=[1.0, 0.9, 1.0],
        top_k=[0, 0, 5],
        **kwargs,
    )
    c, _ = sampler.generate(
        [[1, 2]] * 3,
        key=jax.random.key(2),
        temperature=[0.5, 1.3, 1.0],
        top_p=[0.5, 1.0, 0.8],
        top_k=[3, 0, 0],
        **kwargs,
    )
    assert sampler.programs.decode._cache_size() == compiled
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_a_row_samples_by_its_stream_whatever_the_batch_around_it(model):
    """At temperature 1, a row fed a prompt on stream 7 draws the same tokens (and logprobs) alone in a
    one-row session as in row 2 of four beside other prompts and streams, fed after them; another
    stream or another key draws otherwise."""
    cfg, params, _ = model
    sampler = Sampler(cfg, params, decode_chunk=4, min_cache=32)
    prompt = [3, 1, 4, 1, 5]

    def sampled(batch, row, key=0, stream=7, others=()):
        session = sampler.session(batch)
        for other_row, other in others:
            session.feed([other_row], [other], max_new_tokens=12, temperature=1.0, stream=other_row + 100)
        session.feed([row], [prompt], max_new_tokens=10, temperature=1.0, stream=stream)
        done = {}
        while session.running:
            done.update(session.step(jax.random.key(key)))
        return done[row]

    alone = sampled(1, 0)
    crowded = sampled(4, 2, others=[(0, [9, 9, 2]), (1, list(range(20, 44))), (3, [7])])
    assert crowded.token_ids == alone.token_ids
    assert np.abs(np.array(crowded.logprobs) - np.array(alone.logprobs)).max() <= 1e-5
    assert sampled(1, 0, stream=8).token_ids != alone.token_ids
    assert sampled(1, 0, key=1).token_ids != alone.token_ids


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = jax.random.normal(jax.random.key(0), (4, 50)) * 3
    greedy = np.asarray(jnp.argmax(logits, -1))
    for top_p, top_k in (([1.0] * 4, [1] * 4), ([1e-6] * 4, [0] * 4)):
        keys = jax.random.split(jax.random.key(1), 4)
        tokens, logp = sample_from_logits(logits, keys, jnp.ones(4), jnp.asarray(top_p), jnp.asarray(top_k))
        assert np.array_equal(np.asarray(tokens), greedy) and np.allclose(np.asarray(logp), 0.0, atol=1e-6)


def _sorted_truncation(scaled, top_p, top_k):
    """Reference top-k / top-p by sorting (what the bisection must reproduce)."""
    keep = np.zeros(scaled.shape, bool)
    for b in range(scaled.shape[0]):
        order = np.argsort(-scaled[b], kind="stable")
        probs = np.exp(scaled[b][order] - scaled[b].max())
        probs /= probs.sum()
        kept = np.cumsum(probs) - probs < top_p[b]
        if top_k[b] > 0:
            kept &= np.arange(len(order)) < top_k[b]
        keep[b, order[kept]] = True
    return keep


def test_truncation_matches_sorting_reference():
    rng = np.random.RandomState(0)
    for _ in range(5):
        scaled = (rng.randn(6, 1000) * rng.uniform(0.5, 5)).astype(np.float32)
        top_p = rng.uniform(0.05, 1.0, 6).astype(np.float32)
        top_k = rng.randint(0, 50, 6).astype(np.int32)
        top_p[0], top_k[1] = 1.0, 0
        ours = np.isfinite(np.asarray(truncate_logits(jnp.asarray(scaled), jnp.asarray(top_p), jnp.asarray(top_k))))
        assert np.array_equal(ours, _sorted_truncation(scaled, top_p, top_k))


def test_top_k_restricts_support():
    logits = jax.random.normal(jax.random.key(0), (2, 30))
    allowed = np.argsort(-np.asarray(logits), -1)[:, :3]
    sample = jax.jit(
        lambda key: sample_from_logits(logits, jax.random.split(key, 2), jnp.ones(2), jnp.ones(2), jnp.full(2, 3))
    )
    for seed in range(20):
        tokens, _ = sample(jax.random.key(seed))
        assert all(t in allowed[b] for b, t in enumerate(np.asarray(tokens)))


def test_stop_tokens_stop_strings_and_context(model):
    cfg, params, _ = model
    text_of = lambda ids: "".join(chr(65 + i % 26) for i in ids)  # one character per token
    sampler = Sampler(cfg, params, detokenize=text_of, max_context=40)
    probe, _ = sampler.generate([[1, 2, 3]], key=jax.random.key(0), max_new_tokens=10)
    ids = probe[0].token_ids
    stopped, _ = sampler.generate([[1, 2, 3]], key=jax.random.key(0), max_new_tokens=10, stop_token_ids=[ids[4]])
    assert stopped[0].token_ids == ids[: ids.index(ids[4]) + 1] and stopped[0].finish_reason == FINISH_STOP
    stop = text_of(ids[5:7])
    by_string, cache = sampler.generate([[1, 2, 3]], key=jax.random.key(0), max_new_tokens=10, stop_strings=[stop])
    cut = text_of(ids).find(stop)
    assert by_string[0].finish_reason == FINISH_STOP and by_string[0].text == text_of(ids)[:cut]
    assert by_string[0].token_ids == ids[: cut + 2] and int(cache.lengths[0]) == 3 + cut + 2
    long, _ = sampler.generate([[1] * 30], key=jax.random.key(0), max_new_tokens=50)
    assert long[0].finish_reason == FINISH_CONTEXT and len(long[0].token_ids) == 40 - 30
    too_long, _ = sampler.generate([[1] * 45, [2]], key=jax.random.key(0), max_new_tokens=3)
    assert too_long[0].finish_reason == FINISH_CONTEXT and too_long[0].token_ids == []
    assert len(too_long[1].token_ids) == 3


def test_bad_arguments_fail_clearly(model):
    cfg, params, _ = model
    sampler = Sampler(cfg, params)
    with pytest.raises(ValueError, match="at least one token"):
        sampler.generate([[]], key=jax.random.key(0))
    with pytest.raises(ValueError, match="detokenize"):
        sampler.generate([[1]], key=jax.random.key(0), stop_strings=["x"])
    with pytest.raises(ValueError, match="shape"):
        sampler.generate([[1], [2]], key=jax.random.key(0), temperature=[1.0, 1.0, 1.0])


def test_common_prefix_length():
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert common_prefix_length([[1, 2], [1, 2, 3]]) == 2
    assert common_prefix_length([[4, 5, 6]] * 3) == 3
    assert common_prefix_length([[1, 2], [3, 2]]) == 0
    assert common_prefix_length([[7, 8]]) == 2
    assert common_prefix_length([]) == 0


def test_shared_prefix_length_keeps_a_prompt_token_per_row():
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]], 1) == 2
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 5]], 1) == 2
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 5]], 3) == 0
    assert shared_prefix_length([[1, 2, 3]], 1) == 0
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]], None) == 0


PREFIX = list(range(3, 43))  # 40 tokens every prompt starts with
SUFFIXES = [[50], [51, 52, 53], [54, 55, 56, 57, 58, 59, 60], [61, 62], [63, 64, 65, 66, 67]]
SHARING_CASES = {
    "suffixes": ([PREFIX + s for s in SUFFIXES], lora.NO_ADAPTER),
    "mixed_adapters": ([PREFIX + s for s in SUFFIXES], [0, 1, lora.NO_ADAPTER, 0, 1]),
    "identical": ([PREFIX + [50]] * 4, [1, 0, 1, 0]),
}


def _two_adapters(cfg):
    ad = lora.init_adapters(jax.random.key(0), cfg, lora.LoraSpec(rank=4, targets=lora.ALL_TARGETS), 2)
    return lora.Adapters(jax.tree.map(lambda w: w + 0.05, ad.weights), ad.scale)


def _recorded_sampler(cfg, params, min_shared_prefix, **options):
    """A sampler over two adapters whose prefill calls append ("prefix" or "rows", each row's num_new) to
    `.prefills`: of prefix slots, and of rows."""
    sampler = Sampler(
        cfg,
        params,
        adapters=_two_adapters(cfg),
        decode_chunk=4,
        min_cache=32,
        min_shared_prefix=min_shared_prefix,
        **options,
    )
    sampler.prefills = []

    def recording(prefill, kind):
        def call(*args):
            sampler.prefills.append((kind, np.asarray(args[-2]).tolist()))  # (..., num_new, adapter_idx)
            return prefill(*args)

        return call

    sampler.programs.prefill = recording(sampler.programs.prefill, "prefix")
    sampler.programs.prefill_rows = recording(sampler.programs.prefill_rows, "rows")
    return sampler


def _prefilled(sampler, kind: str = "rows") -> list[int]:
    """The tokens each row got in `kind` prefill calls (however the calls grouped the rows), sorted."""
    return sorted(n for k, calls in sampler.prefills if k == kind for n in calls if n)


def _assert_same_outputs(shared, plain, tolerance=1e-5):
    assert [o.token_ids for o in shared] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in shared] == [o.finish_reason for o in plain]
    assert max(np.abs(np.subtract(a.logprobs, b.logprobs)).max() for a, b in zip(shared, plain)) <= tolerance


@pytest.mark.parametrize("case", SHARING_CASES)
def test_shared_prefix_prefill_equals_per_row_prefill(each_family, case):
    cfg, params, _ = each_family
    prompts, adapter_idx = SHARING_CASES[case]
    shared_len = min(common_prefix_length(prompts), min(map(len, prompts)) - 1)
    groups = len(set(np.broadcast_to(adapter_idx, len(prompts)).tolist()))
    kwargs = dict(key=jax.random.key(0), max_new_tokens=10, adapter_idx=adapter_idx)
    sharing, plain = _recorded_sampler(cfg, params, 4), _recorded_sampler(cfg, params, None)
    shared_out, shared_cache = sharing.generate(prompts, **kwargs)
    plain_out, plain_cache = plain.generate(prompts, **kwargs)
    # Gemma's sqrt(hidden)-scaled embeddings and (1 + w) norms carry fp32 rounding further through these adapted
    # rows: there both paths sit up to 6e-5 from the full forward with the row's adapter, and from each other.
    tolerance = 2e-4 if cfg.family == "gemma3" else 1e-5
    _assert_same_outputs(shared_out, plain_out, tolerance)
    assert shared_cache.batch == plain_cache.batch
    assert np.array_equal(np.asarray(shared_cache.sequence_lengths), np.asarray(plain_cache.sequence_lengths))
    # The prefix is prefilled once per adapter, then only the suffixes; without sharing, whole prompts.
    # Either way a row that opens like an earlier one (same adapter and tokens) is copied, not prefilled.
    assert sharing.prefills[0][0] == "prefix" and _prefilled(sharing, "prefix") == [shared_len] * groups
    first: dict[tuple, int] = {}
    prefilled = [
        first.setdefault((a, tuple(p)), i) == i
        for i, (p, a) in enumerate(zip(prompts, np.broadcast_to(adapter_idx, len(prompts)).tolist()))
    ]
    assert _prefilled(sharing) == sorted(n for p, f in zip(prompts, prefilled) if (n := (len(p) - shared_len) * f))
    assert _prefilled(plain, "prefix") == [] and _prefilled(plain) == sorted(
        len(p) for p, f in zip(prompts, prefilled) if f
    )

    turn2, rows = [[70, 71], [72]], [3, 0]
    kwargs = dict(
        key=jax.random.key(1), max_new_tokens=6, rows=rows, adapter_idx=np.broadcast_to(adapter_idx, len(prompts))[rows]
    )
    shared_next, shared_cache = sharing.generate(turn2, cache=shared_cache, **kwargs)
    plain_next, plain_cache = plain.generate(turn2, cache=plain_cache, **kwargs)
    _assert_same_outputs(shared_next, plain_next, tolerance)
    assert np.array_equal(np.asarray(shared_cache.sequence_lengths), np.asarray(plain_cache.sequence_lengths))


def test_shared_prefix_sampling_draws_the_same_tokens(model):
    cfg, params, _ = model
    prompts, adapter_idx = SHARING_CASES["mixed_adapters"]
    kwargs = dict(key=jax.random.key(3), max_new_tokens=12, temperature=1.0, adapter_idx=adapter_idx)
    sharing = _recorded_sampler(cfg, params, 4)
    shared, _ = sharing.generate(prompts, **kwargs)
    plain, _ = _recorded_sampler(cfg, params, None).generate(prompts, **kwargs)
    assert [kind for kind, _ in sharing.prefills].count("prefix") == 1
    _assert_same_outputs(shared, plain)
    other, _ = sharing.generate(prompts, **{**kwargs, "key": jax.random.key(4)})
    assert [o.token_ids for o in other] != [o.token_ids for o in shared]  # the key decides, not the sharing


def test_shared_prefix_shorter_than_the_threshold_is_prefilled_per_row(model):
    cfg, params, _ = model
    prompts, _ = SHARING_CASES["suffixes"]
    sampler = _recorded_sampler(cfg, params, len(PREFIX) + 1)
    sampler.generate(prompts, key=jax.random.key(0), max_new_tokens=2)
    sampler.generate(prompts[:1], key=jax.random.key(0), max_new_tokens=2)  # one prompt: nothing to share
    assert _prefilled(sampler, "prefix") == [] and _prefilled(sampler) == sorted([*map(len, prompts), len(prompts[0])])


def test_shared_prefix_on_a_mesh_equals_per_row_prefill(model):
    cfg, params, _ = model
    plan = ShardingPlan(make_mesh(data=2, fsdp=2, tensor=2))
    prompts, adapter_idx = SHARING_CASES["mixed_adapters"]
    kwargs = dict(key=jax.random.key(0), max_new_tokens=8, adapter_idx=adapter_idx)
    sharing = _recorded_sampler(cfg, params, 4, plan=plan)
    shared, cache = sharing.generate(prompts, **kwargs)
    plain, _ = _recorded_sampler(cfg, params, None).generate(prompts, **kwargs)
    assert [kind for kind, _ in sharing.prefills].count("prefix") == 1 and cache.batch % plan.batch_multiple == 0
    _assert_same_outputs(shared, plain)
