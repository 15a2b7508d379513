"""The fused session policy (accelerators: fed tokens folded into decode steps, many steps a call, stops on the
device, programs compiled ahead), exercised on the CPU: it samples what the adaptive policy does, compiles
nothing after its warm-up, and its device-side stops end rows where the host would cut them."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from trace_jax import lora
from trace_jax.agent.rollout import MODEL, EpisodeSpec, RolloutConfig, RolloutEngine
from trace_jax.envs.embedded_retail import EmbeddedRetail
from trace_jax.envs.scripted import StoppingUser
from trace_jax.models.config import ModelConfig
from trace_jax.models.loading import load_params
from trace_jax.models.model import load_model
from trace_jax.runtime import ProgramLog
from trace_jax.sampling import FINISH_LENGTH, FINISH_STOP, FusedSession, Sampler, Session
from trace_jax.sampling import sampler as sampler_module
from trace_jax.sharding import ShardingPlan, make_mesh


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def each_family(request, tiny_checkpoints):
    path, _ = tiny_checkpoints[request.param]
    cfg = ModelConfig.from_dir(path)
    return cfg, load_params(path, cfg)


def _play(sampler: Sampler) -> dict[int, list]:
    """Rows fed at different times at temperature 1 (each on its own stream): row 1's 75-token prompt takes
    several calls to feed, row 2 joins while the others sample, and a row whose turn ends is fed its next turn
    at once, twice. Returns each row's completions in order."""
    rng = np.random.default_rng(3)
    session = sampler.session(4)
    prompts = {0: [1, 2, 3], 1: rng.integers(1, 100, size=75).tolist(), 2: [4, 5], 3: [9] * 20}
    budgets = {0: 10, 1: 6, 2: 3, 3: 13}
    feed = lambda rows, tokens: session.feed(
        rows, tokens, max_new_tokens=[budgets[r] for r in rows], temperature=1.0, stream=[r + 50 for r in rows]
    )
    feed([0, 1, 3], [prompts[0], prompts[1], prompts[3]])
    outputs = {r: [] for r in range(4)}
    key = jax.random.key(7)

    def take(done):
        for row, completion in done.items():
            outputs[row].append(completion)
            if len(outputs[row]) < 3:
                feed([row], [[11 + row, 12 + row]])

    take(session.step(key))
    feed([2], [prompts[2]])
    while session.running:
        take(session.step(key, return_early=True))
    return outputs, session.stats


def test_a_fused_session_samples_what_an_adaptive_one_does(each_family):
    """The same rows fed at different times, sampled at temperature 1: every turn of every row draws the same
    tokens with the same logprobs under either policy (each token's key is its row's stream and position, and
    a fused call's chunked feeds compute what row-wise prefills do, whether a step feeds its rows in full or
    takes the one fed row out into a lane), Gemma's sliding window included."""
    cfg, params = each_family
    options = dict(decode_chunk=8, min_cache=32, prefill_chunk=16, max_context=256)
    adaptive, _ = _play(Sampler(cfg, params, policy="adaptive", **options))
    fused_sampler = Sampler(cfg, params, policy="fused", feed_chunks=2, **options)
    fused, stats = _play(fused_sampler)
    assert fused_sampler.min_shared_prefix is None  # no prefix slots: they would add shapes
    assert stats["full_feed_steps"] >= 1 and stats["lane_feed_steps"] >= 1  # three rows fed at once, then one
    for row in range(4):
        assert len(fused[row]) == len(adaptive[row]) == 3
        for ours, theirs in zip(fused[row], adaptive[row]):
            assert ours.token_ids == theirs.token_ids and ours.finish_reason == theirs.finish_reason == FINISH_LENGTH
            assert np.abs(np.array(ours.logprobs) - np.array(theirs.logprobs)).max() <= 1e-5


def test_a_started_row_copies_the_head_it_shares_with_a_held_conversation_and_samples_as_if_fed(tiny_checkpoints):
    """Under the fused policy, a row starting a conversation whose first prompt shares a long head with one a row
    holds copies those positions (as far as they are computed) before the next call instead of feeding them, also
    when the row it copies from is released meanwhile, whose head stays a source until it is fed again; a row being
    copied to is no source. The copied rows then
    draw the tokens (and logprobs) of rows fed their whole prompts, and nothing compiles after the warm-up."""
    path, _ = tiny_checkpoints["qwen3"]
    cfg = ModelConfig.from_dir(path)
    options = dict(decode_chunk=8, min_cache=32, prefill_chunk=16, max_context=256, min_shared_prefix=16)
    sampler = Sampler(cfg, load_params(path, cfg), policy="fused", feed_chunks=2, **options)
    head = np.random.default_rng(5).integers(1, 100, size=40).tolist()
    prompts = {0: head + [1, 2, 3], 1: head + [4, 5], 2: head[:20] + [7, 8, 9]}
    key = jax.random.key(3)

    def run(session, rows, held):
        session.feed(rows, [prompts[r][held[r] :] for r in rows], max_new_tokens=6, temperature=1.0, stream=rows)
        done = {}
        while session.running:
            done.update(session.step(key))
        return done

    session = sampler.session(3)
    with ProgramLog() as programs:
        assert session.start(0, prompts[0]) == 0  # nothing held yet
        first = run(session, [0], {0: 0})
        held = {1: session.start(1, prompts[1]), 2: session.start(2, prompts[2])}
        assert held == {1: 40, 2: 20}  # row 2 shares 20 with row 0's head; row 1, being copied to, is no source
        session.release([0])  # its positions stay until the copies run, before the next call
        copied = run(session, [1, 2], held)
        assert (session.stats["copied_rows"], session.stats["copied_tokens"]) == (2, 60)
        # prefilled: row 0's whole prompt, then what rows 1 and 2 did not copy, each after its copied head
        assert session.stats["prefill_positions"] == sum(range(43)) + sum(range(40, 42)) + sum(range(20, 23))
        # A released row's head stays a source until the row is fed again: here for the row itself, restarted.
        assert session.start(0, prompts[0]) == len(prompts[0]) - 1
        again = run(session, [0], {0: len(prompts[0]) - 1})
        session.release([0, 1, 2])  # the cache keeps room for the heads they leave
        assert session.start(1, prompts[1]) == len(prompts[1]) - 1
        once_more = run(session, [1], {1: len(prompts[1]) - 1})
        fed = run(sampler.session(3), [1, 2], {1: 0, 2: 0})
    assert programs.built == 0
    assert again[0].token_ids == first[0].token_ids and len(first[0].token_ids) == 6
    assert once_more[1].token_ids == fed[1].token_ids
    for row in (1, 2):
        assert copied[row].token_ids == fed[row].token_ids and len(fed[row].token_ids) == 6
        assert np.abs(np.array(copied[row].logprobs) - np.array(fed[row].logprobs)).max() <= 1e-5


def test_a_fused_call_runs_many_steps_and_stops_on_the_device_where_the_host_cuts(tiny_checkpoints):
    """A call runs its `decode_chunk` steps while no row finishes, `return_early` or not (its first step feeds
    the prompt), and `step` reads a call after dispatching the next. A stop string whose token
    form is sampled ends the row on the device at the token where the host cuts it (the call stops there, as
    every row is done), with the same completion and cache length as the host-only detection of the adaptive
    policy and of a fused sampler that cannot tokenize."""
    path, _ = tiny_checkpoints["qwen3"]
    cfg = ModelConfig.from_dir(path)
    params = load_params(path, cfg)
    text_of = lambda ids: "".join(f"<{i}>" for i in ids)
    tokens_of = lambda text: [int(i) for i in re.findall(r"<(\d+)>", text)]
    make = lambda policy, **more: Sampler(
        cfg, params, policy=policy, decode_chunk=8, min_cache=32, detokenize=text_of, max_context=128, **more
    )
    fused = make("fused", tokenize=tokens_of)
    session = fused.session(2)
    assert isinstance(session, FusedSession)
    session.feed([0], [[1, 2, 3]], max_new_tokens=20)
    assert session.step(jax.random.key(0), return_early=True) == {}  # dispatched: a step feeding the prompt, 7 more
    assert session.partial(0)[0] == [] and session.stats["decode_calls"] == 0  # in flight
    assert session.step(jax.random.key(0), return_early=True) == {}  # the first read, the second dispatched
    assert len(session.partial(0)[0]) == 7 and session.stats["decode_steps"] == 8
    assert session.step(jax.random.key(0), return_early=True) == {}
    assert len(session.partial(0)[0]) == 15 and session.stats["decode_calls"] == 2

    probe, _ = make("adaptive").generate([[1, 2, 3]], key=jax.random.key(0), max_new_tokens=20)
    ids = probe[0].token_ids
    stop = text_of(ids[9:11])
    cut = next(i for i in range(len(ids)) if ids[i : i + 2] == ids[9:11]) + 2
    results = {}
    for name, sampler in (("device", fused), ("host", make("fused")), ("adaptive", make("adaptive"))):
        session = sampler.session(1)
        session.feed([0], [[1, 2, 3]], max_new_tokens=20, stop_strings=[[stop]])
        done = {}
        while session.running:
            done.update(session.step(jax.random.key(0)))
        results[name] = (done[0], int(np.asarray(session.cache.lengths)[0]), session.stats["decode_steps"])
    for completion, length, _ in results.values():
        assert completion.token_ids == ids[:cut] and completion.finish_reason == FINISH_STOP
        assert completion.text == text_of(ids[:cut])[: -len(stop)] and length == 3 + cut
    assert results["device"][2] == 1 + cut  # the feeding step, then the device stopped at the form
    assert results["host"][2] == 8 * -(-(1 + cut) // 8) > 1 + cut  # without forms, the call ran on to its end


def test_an_engine_compiles_nothing_after_the_warm_up(tiny_chat_model):
    """Episodes of varied lengths (tickets, turns, tool results, a cut turn) played by the rollout engine on a
    fused sampler after its warm-up (the session `Sampler.session` opens for the engine's rows): no XLA compile,
    whatever capacity the cache grows or shrinks to."""
    env = EmbeddedRetail(seed=0)
    model = load_model(tiny_chat_model)
    sampler = Sampler(
        model.cfg,
        model.params,
        policy="fused",
        detokenize=model.tokenizer.decode,
        tokenize=model.tokenizer.encode,
        decode_chunk=8,
        prefill_chunk=64,
        min_cache=256,
        max_context=4096,
    )
    config = RolloutConfig(batch_size=4, max_turns=3, max_tokens_per_turn=24, temperature=1.0)
    engine = RolloutEngine(
        env, agent=MODEL, user=StoppingUser(), sampler=sampler, tokenizer=model.tokenizer, config=config
    )
    sampler.session(config.batch_size, stop_token_ids=model.tokenizer.eos_token_ids)  # the warm-up
    specs, key = [EpisodeSpec(task, trial) for task in env.tasks("heldout", 5) for trial in range(2)], jax.random.key(1)
    with ProgramLog() as programs:
        played = engine.run(specs, key=key)
    assert programs.built == 0
    assert len({len(t.token_ids) for t in played}) >= 5 and all(t.generated_tokens > 0 for t in played)
    assert engine.stats["resizes"] >= 1  # the cache changed capacity on the way


def test_the_policy_defaults_by_backend_and_a_bad_one_is_named(tiny_checkpoints, monkeypatch):
    path, _ = tiny_checkpoints["qwen3"]
    cfg = ModelConfig.from_dir(path)
    params = load_params(path, cfg)
    assert Sampler(cfg, params).policy == "adaptive" and type(Sampler(cfg, params).session(2)) is Session
    monkeypatch.setattr(sampler_module.jax, "default_backend", lambda: "gpu")
    assert sampler_module.default_policy() == "fused"
    with pytest.raises(ValueError, match="policy must be one of .*'fused'.*'eager'"):
        Sampler(cfg, params, policy="eager")


def test_a_row_cancelled_while_its_call_is_in_flight_keeps_nothing_of_it(tiny_checkpoints):
    """A server's client goes away while its row's call is in flight and the row takes the next request at once:
    the new request samples what it would in a fresh session, and the row beside it goes on undisturbed."""
    path, _ = tiny_checkpoints["qwen3"]
    cfg = ModelConfig.from_dir(path)
    params = load_params(path, cfg)
    sampler = Sampler(cfg, params, policy="fused", decode_chunk=4, min_cache=32, max_context=128)
    alone = lambda prompt, n: sampler.generate([prompt], key=jax.random.key(0), max_new_tokens=n)[0][0].token_ids
    session = sampler.session(2)
    session.feed([0, 1], [[1, 2, 3], [5, 6, 7, 8]], max_new_tokens=[10, 20])
    session.step(jax.random.key(0))  # dispatched
    session.cancel([1])
    session.feed([1], [[9, 10]], max_new_tokens=6)
    done = {}
    while session.running:
        done.update(session.step(jax.random.key(0)))
    assert done[0].token_ids == alone([1, 2, 3], 10) and done[1].token_ids == alone([9, 10], 6)
    assert np.asarray(session.cache.lengths)[1] == 2 + 6


def test_a_fused_session_on_a_mesh_compiles_nothing_after_its_warm_up(tiny_checkpoints):
    """On 8 devices (data 2, fsdp 2, tensor 2), with two adapters: the warm-up compiles the fused programs for the
    mesh's shardings, and the session then samples what an unsharded adaptive one does, compiling nothing."""
    path, _ = tiny_checkpoints["qwen3"]
    cfg = ModelConfig.from_dir(path)
    params = load_params(path, cfg)
    adapters = lora.stack_adapters([lora.init_adapters(jax.random.key(s), cfg, lora.LoraSpec(rank=2)) for s in (1, 2)])
    adapters = lora.Adapters(jax.tree.map(lambda w: w + 0.05, adapters.weights), adapters.scale)
    options = dict(adapters=adapters, decode_chunk=8, min_cache=32, prefill_chunk=16, max_context=256)
    plan = ShardingPlan(make_mesh(data=2, fsdp=2, tensor=2))
    fused = Sampler(cfg, params, plan=plan, policy="fused", min_shared_prefix=16, **options)
    prompts = [[1, 2, 3], list(range(5, 60)), [7] * 9, [4, 4]]
    play = lambda sampler: _play_all(sampler, prompts, adapter_idx=[0, 1, -1, 1])
    fused.session(4)  # compiles the programs of `play`'s 4-row sessions
    session = fused.session(8)  # lanes of 4 rows (the mesh's batch axes): the rows fed apart from the others
    with ProgramLog() as programs:
        ours = play(fused)
        for row, last in ((0, 1), (1, 2)):  # the second conversation copies the first one's head
            assert session.start(row, prompts[1] + [last], adapter_idx=1) == (0 if row == 0 else len(prompts[1]))
            session.feed(
                [row], [[*prompts[1], last][session.stats["copied_tokens"] :]], max_new_tokens=2, adapter_idx=1
            )
            while session.running:
                session.step(jax.random.key(0))
        assert session.stats["copied_rows"] == 1 and session.stats["lane_feed_steps"] >= 2
    theirs = play(Sampler(cfg, params, policy="adaptive", **options))
    assert programs.built == 0 and isinstance(session, FusedSession)
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids and np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max() <= 1e-4


def _play_all(sampler: Sampler, prompts: list[list[int]], adapter_idx: list[int]) -> list:
    """Each prompt in its row of a 4-row session, greedy, 12 tokens each; the completions by row."""
    session = sampler.session(4)
    session.feed(list(range(len(prompts))), prompts, max_new_tokens=12, adapter_idx=adapter_idx)
    done = {}
    while session.running:
        done.update(session.step(jax.random.key(0)))
    return [done[r] for r in range(len(prompts))]
