"""Learner checkpoints: bit-exact round trips, retention, save cadence, and crash safety."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trace_jax.lora import LoraSpec, init_adapters
from trace_jax.models.config import ModelConfig
from trace_jax.rl.checkpoint import Checkpointer, TrainState
from trace_jax.rl.learner import make_optimizer

CFG = ModelConfig(
    vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8
)
OPTIMIZER = make_optimizer(lr=1e-2)


@jax.jit
def _init(key: jax.Array) -> tuple:
    adapters = init_adapters(key, CFG, LoraSpec(rank=4, targets=("q", "v")), 2)
    return adapters.weights, adapters.scale, OPTIMIZER.init(adapters.weights)


@jax.jit
def _update(weights, opt_state, rng: jax.Array, step: jax.Array) -> tuple:
    """A real optax update with made-up gradients, and the key advanced (one small program: quick to compile)."""
    grads = jax.tree.map(lambda w: jnp.sin(7.0 * w + step), weights)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, weights)
    return optax.apply_updates(weights, updates), opt_state, jax.random.split(rng)[0]


def fresh_state(impl: str = "threefry2x32") -> TrainState:
    """Step 0 from a fixed seed; also the restore template. (An rbg init key: threefry compiles slowly on CPU.)"""
    weights, scale, opt_state = _init(jax.random.key(0, impl="rbg"))
    return TrainState(
        step=0,
        adapter_weights=weights,
        scale=scale,
        opt_state=opt_state,
        rng=jax.random.key(1, impl=impl),
        cursor={"epoch": 0, "next_prompt": 0},
    )


def fake_step(state: TrainState) -> TrainState:
    """A deterministic stand-in for a learner step."""
    step = state.step + 1
    weights, opt_state, rng = _update(state.adapter_weights, state.opt_state, state.rng, step)
    return TrainState(
        step=step,
        adapter_weights=weights,
        scale=state.scale,
        opt_state=opt_state,
        rng=rng,
        cursor={"epoch": step // 5, "next_prompt": 3 * step % 11},
    )


def state_at(step: int, impl: str = "threefry2x32") -> TrainState:
    state = fresh_state(impl)
    for _ in range(step):
        state = fake_step(state)
    return state


def assert_same(got: TrainState, want: TrainState) -> None:
    """Bit-exact equality of every part, including pytree structure (optax namedtuples) and the key's impl."""
    assert got.step == want.step and got.cursor == want.cursor
    for name in ("adapter_weights", "scale", "opt_state"):
        g, w = getattr(got, name), getattr(want, name)
        assert jax.tree.structure(g) == jax.tree.structure(w), name
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert jax.random.key_impl(got.rng) == jax.random.key_impl(want.rng)
    np.testing.assert_array_equal(jax.random.key_data(got.rng), jax.random.key_data(want.rng))
    np.testing.assert_array_equal(jax.random.normal(got.rng, (8,)), jax.random.normal(want.rng, (8,)))


def saved_steps(directory: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_round_trip_is_bit_exact(tmp_path, impl):
    state = state_at(2, impl)
    adam = state.opt_state[1][0]
    assert isinstance(adam, optax.ScaleByAdamState) and int(adam.count) == 2
    assert all(np.any(np.asarray(m) != 0) for m in jax.tree.leaves(adam.mu))
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.save(state)
        restored = ckpt.restore(fresh_state(impl))
    assert_same(restored, state)
    assert isinstance(restored.opt_state[1][0], optax.ScaleByAdamState)


def test_rng_impl_mismatch_is_an_error(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(state_at(1, "rbg"))
        with pytest.raises(ValueError, match="RNG key"):
            ckpt.restore(fresh_state("threefry2x32"))


def test_keep_deletes_older_and_latest_is_newest(tmp_path):
    state = fresh_state()
    with Checkpointer(tmp_path, keep=2) as ckpt:
        for _ in range(4):
            state = fake_step(state)
            assert ckpt.save(state)
        assert saved_steps(tmp_path) == [3, 4]
        assert ckpt.latest_step() == 4
        assert_same(ckpt.restore(fresh_state()), state)
        assert ckpt.restore(fresh_state(), step=3).step == 3
        with pytest.raises(FileNotFoundError, match="step 1"):
            ckpt.restore(fresh_state(), step=1)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    state = fresh_state()
    with Checkpointer(tmp_path, keep=3) as ckpt:
        assert ckpt.restore_newest_readable(fresh_state()) is None  # nothing saved yet
        for _ in range(2):
            state = fake_step(state)
            ckpt.save(state)
    for path in (tmp_path / "2" / "arrays").rglob("*"):
        if path.is_file():
            path.write_bytes(b"\0" * 7)  # every file of the newest step's arrays garbled
    with Checkpointer(tmp_path, keep=3) as ckpt:
        restored = ckpt.restore_newest_readable(fresh_state())
    assert_same(restored, state_at(1))
    assert "checkpoint step 2" in caplog.text and "trying the previous one" in caplog.text


def test_save_every_skips_and_force_saves(tmp_path):
    state = fresh_state()
    with Checkpointer(tmp_path, save_every=3) as ckpt:
        written = []
        for _ in range(7):
            state = fake_step(state)
            written.append(ckpt.save(state))
        assert written == [False, False, True, False, False, True, False]
        assert ckpt.save(state, force=True) and ckpt.latest_step() == 7
        assert not ckpt.save(state, force=True)  # already on disk
    assert saved_steps(tmp_path) == [3, 6, 7]


def test_empty_directory_gives_a_clear_error(tmp_path):
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(FileNotFoundError, match="no finished checkpoint in .*ckpt"):
            ckpt.restore(fresh_state())


def test_leftover_partial_directories_are_ignored(tmp_path):
    """What a kill can leave behind: half-written steps (orbax tmp dirs) are neither listed nor restored,
    and saving that step again replaces them; a half-deleted oldest step (kill during rotation) does not
    hide the newer ones and is removed by the next rotation."""
    state = state_at(2)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(state_at(1))
        ckpt.save(state)
    for name in ("3.orbax-checkpoint-tmp", "4.orbax-checkpoint-tmp-1700000000000000"):
        partial = shutil.copytree(tmp_path / "2", tmp_path / name)
        shutil.rmtree(partial / "arrays" / "d")  # the array data never got written
    shutil.rmtree(tmp_path / "1" / "arrays")
    with Checkpointer(tmp_path, keep=2) as ckpt:
        assert ckpt.latest_step() == 2
        assert_same(ckpt.restore(fresh_state()), state)
        assert ckpt.save(fake_step(state))
        assert ckpt.latest_step() == 3
        assert_same(ckpt.restore(fresh_state()), fake_step(state))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "3", "4.orbax-checkpoint-tmp-1700000000000000"]


CHILD = """
import sys
sys.path.insert(0, {tests!r})
from test_checkpoint import Checkpointer, fake_step, fresh_state
state = fresh_state()
with Checkpointer({directory!r}, keep=3) as ckpt:
    while True:
        state = fake_step(state)
        ckpt.save(state)
"""


def test_sigkill_mid_training_restores_the_last_saved_step(tmp_path):
    """A training loop saving every step is SIGKILLed; the newest finished checkpoint is exactly that step's state."""
    directory, log = tmp_path / "ckpt", tmp_path / "child.log"
    code = CHILD.format(tests=str(pathlib.Path(__file__).parent), directory=str(directory))
    with log.open("w") as log_file:  # a file, not a pipe: orbax's logging must never block the child
        child = subprocess.Popen([sys.executable, "-c", code], stdout=log_file, stderr=subprocess.STDOUT)
    try:
        with Checkpointer(directory) as watcher:
            deadline = time.monotonic() + 60
            while (watcher.latest_step() or 0) < 3:
                assert child.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, "the child saved no step 3 within 60 s"
                time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    with Checkpointer(directory) as ckpt:
        step = ckpt.latest_step()
        assert step >= 3
        assert_same(ckpt.restore(fresh_state()), state_at(step))
