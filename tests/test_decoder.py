"""The JAX decoder against transformers' forward, and checkpoint loading edge cases."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from trace_jax.models.config import ModelConfig
from trace_jax.models.decoder import forward
from trace_jax.models.loading import load_params, save_hf_checkpoint
from trace_jax.models.model import weights_fingerprint


def _tokens(seed=0, shape=(2, 40), vocab=128):
    return np.random.RandomState(seed).randint(0, vocab, shape)


def _inodes(folder) -> dict[str, int]:
    return {f.name: f.stat().st_ino for f in folder.iterdir()}


def _same_trees(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(np.array_equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_logits_match_transformers(tiny_checkpoints, family):
    path, model = tiny_checkpoints[family]
    cfg = ModelConfig.from_dir(path)
    tokens = _tokens()
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    ours, _ = forward(load_params(path, cfg), jnp.asarray(tokens), cfg)
    assert np.abs(np.asarray(ours) - ref).max() <= 1e-4


def test_variant_flags_come_from_config(tiny_checkpoints):
    cfgs = {f: ModelConfig.from_dir(p) for f, (p, _) in tiny_checkpoints.items()}
    assert cfgs["llama"].rope_scaling is not None and not cfgs["llama"].tie_word_embeddings
    assert cfgs["qwen2"].qkv_bias and cfgs["qwen2"].tie_word_embeddings
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim == 32
    gemma = cfgs["gemma3"]
    assert gemma.local_layers == (True, False) and gemma.sliding_window == 5 and gemma.local_rope_theta == 100.0
    assert gemma.rope_theta == 50000.0 and gemma.attention_scale == 24**-0.5 and gemma.embed_scale == 64**0.5


def test_sharded_index_checkpoint_loads_the_same(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints["qwen3"]
    cfg = ModelConfig.from_dir(path)
    tensors = load_file(str(path / "model.safetensors"))
    names = sorted(tensors)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(tmp_path / fname))
        weight_map.update({n: fname for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert _same_trees(load_params(path, cfg), load_params(tmp_path, cfg))


def test_bf16_loading_keeps_logits_close(tiny_checkpoints):
    path, _ = tiny_checkpoints["llama"]
    cfg = ModelConfig.from_dir(path)
    tokens = jnp.asarray(_tokens(shape=(1, 16)))
    p32, p16 = load_params(path, cfg), load_params(path, cfg, dtype=jnp.bfloat16)
    assert jax.tree.leaves(p16)[0].dtype == jnp.bfloat16
    l32, _ = forward(p32, tokens, cfg)
    l16, _ = forward(p16, tokens, cfg)
    assert np.abs(np.asarray(l32) - np.asarray(l16)).max() < 0.1


def test_save_and_reload_round_trip_and_an_unchanged_save_keeps_the_files(tiny_checkpoints, tmp_path):
    """Saved again with the same weights (a finished SFT job rerun exports its merged folder again), the folder
    keeps its files and so its fingerprint, to which evaluations tie their episodes; other weights replace them."""
    path, _ = tiny_checkpoints["qwen2"]
    cfg = ModelConfig.from_dir(path)
    params, out = load_params(path, cfg), tmp_path / "saved"
    save_hf_checkpoint(params, path, out, cfg)
    assert _same_trees(params, load_params(out, cfg))
    made_by_open = tmp_path / "made_by_open"
    made_by_open.write_bytes(b"")
    assert (out / "model.safetensors").stat().st_mode == made_by_open.stat().st_mode  # readable as any file is
    saved, inodes = weights_fingerprint(out), _inodes(out)
    save_hf_checkpoint(params, path, out, cfg)
    assert weights_fingerprint(out) == saved and _inodes(out) == inodes  # the same files, untouched
    assert not list(out.glob(".*"))  # no temp file left
    moved = jax.tree.map(lambda a: a + 1, params)
    save_hf_checkpoint(moved, path, out, cfg)
    replaced = {name for name, inode in _inodes(out).items() if inode != inodes[name]}
    assert replaced == {"model.safetensors"} and _same_trees(moved, load_params(out, cfg))


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="MistralForCausalLM.*supports"):
        ModelConfig.from_hf_dict({"architectures": ["MistralForCausalLM"], "hidden_size": 8})


def test_mismatched_config_fails_clearly(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints["llama"]
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    hf = json.loads((path / "config.json").read_text())
    hf["num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="unexpected tensors"):
        load_params(tmp_path, ModelConfig.from_dir(tmp_path))


@pytest.mark.parametrize("with_prefix", [False, True])
def test_attention_gradients_match_plain_softmax_attention(with_prefix):
    """`_attention`'s hand-written softmax backward (flash attention's row-sum identity) gives
    the gradients autodiff gives for attention written plainly: kv heads repeated, one masked
    softmax over [prefix keys, own keys] per row."""
    from trace_jax.models.decoder import _attention

    batch, t, heads, kv_heads, hd, slots, plen = 3, 5, 6, 2, 8, 2, 4
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    q, k, v = normal(batch, t, heads, hd), normal(batch, kv_heads, t, hd), normal(batch, kv_heads, t, hd)
    pk, pv = normal(slots, kv_heads, plen, hd), normal(slots, kv_heads, plen, hd)
    pos = jnp.broadcast_to(jnp.arange(t), (batch, t))
    k_valid = jnp.asarray(np.arange(t)[None, :] < np.array([5, 3, 4])[:, None])
    slot_of_row, prefix_len = np.array([1, 0, 1]), np.array([4, 2, 0])
    valid = jnp.asarray(
        (np.arange(slots * plen)[None] // plen == slot_of_row[:, None])
        & (np.arange(slots * plen)[None] % plen < prefix_len[:, None])
    )
    cotangent = normal(batch, t, heads * hd)

    def ours(q, k, v, pk, pv):
        prefix = (pk, pv, valid) if with_prefix else None
        return jnp.sum(_attention(q, k, v, pos, pos, k_valid, prefix) * cotangent)

    def plain(q, k, v, pk, pv):
        own_mask = k_valid[:, None, :] & (pos[:, None, :] <= pos[:, :, None])  # [B, T, S]
        keys, values, mask = k, v, own_mask
        if with_prefix:
            flat = lambda x: jnp.broadcast_to(
                x.transpose(1, 0, 2, 3).reshape(kv_heads, slots * plen, hd), (batch, kv_heads, slots * plen, hd)
            )
            keys, values = jnp.concatenate([flat(pk), k], 2), jnp.concatenate([flat(pv), v], 2)
            mask = jnp.concatenate([jnp.broadcast_to(valid[:, None, :], (batch, t, slots * plen)), own_mask], 2)
        keys, values = (jnp.repeat(x, heads // kv_heads, axis=1) for x in (keys, values))  # [B, H, S, hd]
        scores = jnp.einsum("bthd,bhsd->bhts", q, keys) / np.sqrt(hd)
        probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -1e30), axis=-1)
        out = jnp.einsum("bhts,bhsd->bthd", probs, values).reshape(batch, t, heads * hd)
        return jnp.sum(out * cotangent)

    args = (q, k, v, pk, pv)
    np.testing.assert_allclose(ours(*args), plain(*args), rtol=1e-5)
    for g_ours, g_plain in zip(jax.grad(ours, argnums=range(5))(*args), jax.grad(plain, argnums=range(5))(*args)):
        scale = float(jnp.abs(g_plain).max()) or 1.0
        assert float(jnp.abs(g_ours - g_plain).max()) <= 1e-5 * scale
