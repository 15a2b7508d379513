"""LoRA adapters: per-row mixing, init, merge, stacking, PEFT export/import, errors, sampling."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from hf_checkpoints import make_checkpoint
from safetensors.numpy import load_file, save_file

from trace_jax import lora
from trace_jax.lora import ALL_TARGETS, NO_ADAPTER, Adapters, LoraSpec
from trace_jax.models import decoder
from trace_jax.models.adapters import row_delta
from trace_jax.models.config import ModelConfig
from trace_jax.models.loading import load_params
from trace_jax.sampling import Sampler

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
MIXED_IDX = [0, 2, NO_ADAPTER, 1]


@dataclasses.dataclass
class Model:
    path: pathlib.Path
    torch_model: torch.nn.Module  # never modified: PEFT gets a deep copy
    cfg: ModelConfig
    params: dict


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> Model, each tiny random checkpoint built once for this module, on first use."""
    built: dict[str, Model] = {}

    def get(family: str) -> Model:
        if family not in built:
            path = tmp_path_factory.mktemp(f"lora_{family}")
            torch_model = make_checkpoint(family, path, seed=1)
            cfg = ModelConfig.from_dir(path)
            built[family] = Model(path, torch_model, cfg, load_params(path, cfg))
        return built[family]

    return get


@functools.partial(jax.jit, static_argnums=2)
def _logits(params, tokens, cfg, row_lora):
    return decoder.forward(params, tokens, cfg, row_lora=row_lora)[0]


def logits(model: Model, tokens, adapters: Adapters | None = None, idx=None, params=None) -> np.ndarray:
    """Our fp32 logits; rows use adapters[idx[b]] (all rows adapter 0 when idx is None)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    row_lora = None
    if adapters is not None:
        idx = [0] * tokens.shape[0] if idx is None else idx
        row_lora = lora.for_rows(adapters, jnp.asarray(idx, jnp.int32))
    return np.asarray(_logits(model.params if params is None else params, tokens, model.cfg, row_lora))


def torch_logits(torch_model, tokens) -> np.ndarray:
    with torch.no_grad():
        return torch_model(input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def random_tokens(cfg: ModelConfig, batch: int, length: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, cfg.vocab_size, (batch, length)).astype(np.int32)


def random_adapter(
    key, cfg: ModelConfig, spec: LoraSpec, num: int = 1, a_scale: float | None = None, b_scale: float = 0.1
) -> Adapters:
    """init_adapters with a random normal B (and optionally a random normal A) so it changes the model."""
    ad = lora.init_adapters(key, cfg, spec, num)
    weights = {}
    for i, (target, w) in enumerate(sorted(ad.weights.items())):
        ka, kb = jax.random.split(jax.random.fold_in(key, 1000 + i))
        a = w["a"] if a_scale is None else a_scale * jax.random.normal(ka, w["a"].shape, jnp.float32)
        weights[target] = {"a": a, "b": b_scale * jax.random.normal(kb, w["b"].shape, jnp.float32)}
    return Adapters(weights, ad.scale)


def three_adapters(cfg: ModelConfig) -> Adapters:
    """Three all-target rank-4 adapters with different weights and different alpha (scale 2, 1, 4)."""
    keys = jax.random.split(jax.random.key(7), 3)
    return lora.stack_adapters(
        [
            random_adapter(k, cfg, LoraSpec(rank=4, alpha=alpha, targets=ALL_TARGETS))
            for k, alpha in zip(keys, (8.0, 4.0, 16.0))
        ]
    )


# 1. Mixed adapters in one batch == each row alone.
def test_mixed_batch_rows_equal_each_row_alone(models):
    m = models("llama")
    stack = three_adapters(m.cfg)
    tokens = random_tokens(m.cfg, len(MIXED_IDX))
    mixed = logits(m, tokens, stack, MIXED_IDX)
    worst = 0.0
    for b, idx in enumerate(MIXED_IDX):
        base = logits(m, tokens[b : b + 1])
        if idx == NO_ADAPTER:
            alone = base
        else:
            alone = logits(m, tokens[b : b + 1], lora.select_adapter(stack, idx), [0])
            # The adapter really changes this row, so a wrong pick would show.
            assert max_diff(alone, base) > 1e-3
        worst = max(worst, max_diff(mixed[b], alone[0]))
    assert worst <= 1e-5, worst
    # The three adapters differ from one another (and from the base) on the same tokens.
    per_adapter = logits(m, np.repeat(tokens[:1], 4, axis=0), stack, [0, 1, 2, NO_ADAPTER])
    for i in range(4):
        for j in range(i + 1, 4):
            assert max_diff(per_adapter[i], per_adapter[j]) > 1e-3
    print(f"\n[lora] mixed batch vs alone: max |diff| = {worst:.3g}")


# 1b. The hand-written backward of the per-row LoRA delta equals the formula's gradients.
def test_row_delta_gradients_match_numpy():
    rng = np.random.default_rng(0)
    batch, t, n, d_in, r, d_out = 4, 5, 3, 6, 2, 7
    x, a, b = (rng.standard_normal(s).astype(np.float32) for s in ((batch, t, d_in), (n, d_in, r), (n, r, d_out)))
    mix = np.zeros((batch, n), np.float32)
    mix[[0, 1, 2], [0, 2, 1]] = [0.5, 2.0, 1.5]  # row 3 has no adapter
    dy = rng.standard_normal((batch, t, d_out)).astype(np.float32)
    y, vjp = jax.vjp(row_delta, *map(jnp.asarray, (x, a, b, mix)))
    grads = vjp(jnp.asarray(dy))
    # NumPy: y[b,t] = sum_n mix[b,n] * x[b,t] @ a[n] @ b[n]
    xa = np.einsum("bti,nir->btnr", x, a)
    dh = np.einsum("bto,nro->btnr", dy, b)
    expected = {
        "y": np.einsum("btnr,bn,nro->bto", xa, mix, b),
        "dx": np.einsum("btnr,bn,nir->bti", dh, mix, a),
        "da": np.einsum("bti,btnr,bn->nir", x, dh, mix),
        "db": np.einsum("btnr,bn,bto->nro", xa, mix, dy),
        "dmix": np.einsum("btnr,btnr->bn", dh, xa),
    }
    for name, got in zip(expected, (y, *grads)):
        np.testing.assert_allclose(np.asarray(got), expected[name], rtol=1e-5, atol=1e-5, err_msg=name)
    assert not np.any(np.asarray(y)[3]) and not np.any(np.asarray(grads[0])[3])  # no adapter: no delta, no gradient


# 2. A fresh adapter (B = 0) is exactly the base model.
def test_fresh_adapter_equals_base(models):
    m = models("llama")
    fresh = lora.init_adapters(jax.random.key(3), m.cfg, LoraSpec(rank=4, alpha=32, targets=ALL_TARGETS), 2)
    for w in fresh.weights.values():
        assert float(jnp.abs(w["a"]).max()) > 0 and float(jnp.abs(w["b"]).max()) == 0
    tokens = random_tokens(m.cfg, 4, seed=1)
    diff = max_diff(logits(m, tokens, fresh, [0, 1, NO_ADAPTER, 1]), logits(m, tokens))
    assert diff <= 1e-6, diff
    print(f"\n[lora] fresh adapter vs base: max |diff| = {diff:.3g}")


# 3. Merging the adapter into the weights == applying it per row; all 7 targets.
def test_the_merged_folder_equals_the_adapter_applied_per_row(models, tmp_path):
    """`merge_peft_folder` writes the base folder's weights with a PEFT adapter folded in: the merged model's
    logits equal the base's with the adapter applied per row, every target's kernel moved, each by
    fp32(W + scale * B @ A) with the product in float64 (the merge's bytes follow no CPU's BLAS)."""
    m = models("llama")
    stack = three_adapters(m.cfg)
    assert sorted(stack.weights) == sorted(ALL_TARGETS)
    tokens = random_tokens(m.cfg, 4, seed=2)
    base, base_bytes = logits(m, tokens), (m.path / "model.safetensors").read_bytes()
    base_tensors = load_file(str(m.path / "model.safetensors"))
    worst = 0.0
    for i in range(stack.num_adapters):
        adapter, out = tmp_path / f"adapter_{i}", tmp_path / f"merged_{i}"
        lora.save_peft(stack, adapter, index=i)
        lora.merge_peft_folder(m.path, adapter, out)
        merged = load_file(str(out / "model.safetensors"))
        assert merged.keys() == base_tensors.keys()
        scale = float(stack.scale[i])
        for target in ALL_TARGETS:  # every target's kernel moved, by the float64 product rounded once
            name = f"model.layers.0.{lora._MODULE_OF[target]}.{target}.weight"
            a, b = (np.asarray(stack.weights[target][ab][i, 0], np.float64) for ab in ("a", "b"))
            expected = (base_tensors[name].astype(np.float64) + scale * (a @ b).T).astype(np.float32)
            np.testing.assert_array_max_ulp(merged[name], expected, maxulp=1)
            assert max_diff(merged[name], base_tensors[name]) > 1e-4, target
        out_logits = logits(m, tokens, params=load_params(out, m.cfg))
        assert max_diff(out_logits, base) > 1e-3
        worst = max(worst, max_diff(out_logits, logits(m, tokens, stack, [i] * 4)))
        assert (out / "config.json").read_bytes() == (m.path / "config.json").read_bytes()
    assert worst <= 1e-4, worst
    assert (m.path / "model.safetensors").read_bytes() == base_bytes  # the base folder as it was
    lora.merge_peft_folder(m.path, tmp_path / "adapter_0", tmp_path / "again")  # the same bytes again
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (
        tmp_path / "merged_0" / "model.safetensors"
    ).read_bytes()
    print(f"\n[lora] merged vs unmerged: max |diff| = {worst:.3g}")


def test_a_merged_adapter_of_zero_layers_keeps_the_bases_bytes(models, tmp_path):
    """An adapter whose B is zero (fresh, or a trained one's untrained layers) merges to the base's bytes, -0.0
    weights included: the embedded agents' pinned adapters drop such layers, and a build from the pin must give
    the weights a build from the trained adapter gives."""
    m = models("llama")
    base = tmp_path / "base"
    shutil.copytree(m.path, base)
    tensors = load_file(str(base / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = np.where(np.arange(tensors[name].size).reshape(tensors[name].shape) % 3 == 0, -0.0, tensors[name])
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    fresh = lora.init_adapters(jax.random.key(5), m.cfg, LoraSpec(rank=4, alpha=32, targets=ALL_TARGETS), 1)
    lora.save_peft(fresh, tmp_path / "adapter")
    lora.merge_peft_folder(base, tmp_path / "adapter", tmp_path / "merged")
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert np.signbit(tensors[name]).sum() > 0
    assert all(merged[k].tobytes() == v.tobytes() for k, v in tensors.items())


# 4. Stacking adapters of different ranks and target sets is exact (zero padding / zero fill).
def test_stack_of_different_ranks_and_targets_equals_each_alone(models):
    m = models("llama")
    k1, k2, k3 = jax.random.split(jax.random.key(11), 3)
    parts = [  # rank 2 / 3 / 4, two disjoint target sets and all targets
        random_adapter(k1, m.cfg, LoraSpec(rank=2, alpha=4, targets=("q", "v"))),
        random_adapter(k2, m.cfg, LoraSpec(rank=3, alpha=3, targets=("o_proj", "gate_proj", "up_proj", "down_proj"))),
        random_adapter(k3, m.cfg, LoraSpec(rank=4, alpha=16, targets=ALL_TARGETS), num=2),
    ]
    stack = lora.stack_adapters(parts)
    assert stack.num_adapters == 4 and sorted(stack.weights) == sorted(ALL_TARGETS)
    assert all(w["a"].shape[-1] == 4 and w["b"].shape[2] == 4 for w in stack.weights.values())
    np.testing.assert_array_equal(np.asarray(stack.scale), [2.0, 1.0, 4.0, 4.0])
    originals = [(parts[0], 0), (parts[1], 0), (parts[2], 0), (parts[2], 1)]
    # Weights: the original block is copied exactly, everything else is exactly zero.
    for j, (part, k) in enumerate(originals):
        for target, w in stack.weights.items():
            a, b = np.asarray(w["a"][j]), np.asarray(w["b"][j])
            if target in part.weights:
                r = part.weights[target]["a"].shape[-1]
                np.testing.assert_array_equal(a[..., :r], np.asarray(part.weights[target]["a"][k]))
                np.testing.assert_array_equal(b[:, :r], np.asarray(part.weights[target]["b"][k]))
                assert not a[..., r:].any() and not b[:, r:].any()
            else:
                assert not a.any() and not b.any()
    # Logits: a mixed batch through the stack, and each adapter on every row, vs each adapter alone.
    tokens = random_tokens(m.cfg, 4, seed=3)
    mixed = logits(m, tokens, stack, [0, 1, 2, 3])
    base = logits(m, tokens)
    worst = 0.0
    for j, (part, k) in enumerate(originals):
        alone = logits(m, tokens, lora.select_adapter(part, k), [0] * 4)
        assert max_diff(alone, base) > 1e-3
        worst = max(worst, max_diff(mixed[j], alone[j]), max_diff(logits(m, tokens, stack, [j] * 4), alone))
    assert worst <= 1e-5, worst
    print(f"\n[lora] stacked (padded) vs alone: max |diff| = {worst:.3g}")


# 5. Export: save_peft -> peft.PeftModel.from_pretrained gives our logits.
@pytest.mark.parametrize("family", FAMILIES)
def test_save_peft_loads_in_peft_with_same_logits(models, family, tmp_path):
    m = models(family)
    adapter = random_adapter(
        jax.random.key(5), m.cfg, LoraSpec(rank=4, alpha=8, targets=ALL_TARGETS), a_scale=0.1, b_scale=0.1
    )
    lora.save_peft(adapter, tmp_path, base_model=str(m.path))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    tokens = random_tokens(m.cfg, 4, seed=4)
    ours = logits(m, tokens, adapter)
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(m.torch_model), str(tmp_path)).eval()
    n_lora = sum(1 for name, _ in peft_model.named_parameters() if "lora_B" in name)
    assert n_lora == len(ALL_TARGETS) * m.cfg.num_layers
    ref = torch_logits(peft_model, tokens)
    assert max_diff(ref, torch_logits(m.torch_model, tokens)) > 1e-3  # the adapter matters in PEFT too
    diff = max_diff(ours, ref)
    assert diff <= 1e-4, diff
    # And our own loader reads back exactly what we wrote.
    back = lora.load_peft(tmp_path, m.cfg)
    for target, w in adapter.weights.items():
        np.testing.assert_array_equal(np.asarray(back.weights[target]["a"]), np.asarray(w["a"]))
        np.testing.assert_array_equal(np.asarray(back.weights[target]["b"]), np.asarray(w["b"]))
    np.testing.assert_allclose(np.asarray(back.scale), np.asarray(adapter.scale), rtol=1e-7)
    print(f"\n[lora] save_peft -> PEFT ({family}): max |diff| = {diff:.3g}")


# 6. Import: an adapter made and saved by PEFT -> load_peft gives PEFT's logits.
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "rslora,targets",
    [
        (False, list(ALL_TARGETS)),
        (True, ["q_proj", "v_proj", "up_proj", "down_proj"]),
    ],
)
def test_load_peft_matches_peft_logits(models, family, rslora, targets, tmp_path):
    m = models(family)
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=targets, lora_dropout=0.0, init_lora_weights=False, use_rslora=rslora
    )
    peft_model = peft.get_peft_model(copy.deepcopy(m.torch_model), config).eval()
    tokens = random_tokens(m.cfg, 4, seed=5)
    ref = torch_logits(peft_model, tokens)
    assert max_diff(ref, torch_logits(m.torch_model, tokens)) > 1e-3  # B is non-zero
    peft_model.save_pretrained(str(tmp_path))
    adapter = lora.load_peft(tmp_path, m.cfg)
    assert sorted(adapter.weights) == sorted(targets)
    expected_scale = 16 / 2 if rslora else 16 / 4
    assert float(adapter.scale[0]) == pytest.approx(expected_scale)
    diff = max_diff(logits(m, tokens, adapter), ref)
    assert diff <= 1e-4, diff
    print(f"\n[lora] PEFT -> load_peft ({family}, rslora={rslora}): max |diff| = {diff:.3g}")


@pytest.mark.parametrize("layers", [0, [1]])
def test_load_peft_layers_to_transform(models, layers, tmp_path):
    m = models("llama")
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=list(ALL_TARGETS), init_lora_weights=False, layers_to_transform=layers
    )
    peft_model = peft.get_peft_model(copy.deepcopy(m.torch_model), config).eval()
    tokens = random_tokens(m.cfg, 4, seed=6)
    ref = torch_logits(peft_model, tokens)
    assert max_diff(ref, torch_logits(m.torch_model, tokens)) > 1e-3
    peft_model.save_pretrained(str(tmp_path))
    adapter = lora.load_peft(tmp_path, m.cfg)
    untouched = 1 - (layers if isinstance(layers, int) else layers[0])
    assert not any(np.asarray(w["b"][0, untouched]).any() for w in adapter.weights.values())
    diff = max_diff(logits(m, tokens, adapter), ref)
    assert diff <= 1e-4, diff


# 7. Clear errors.
@pytest.fixture
def saved_adapter(models, tmp_path):
    m = models("llama")
    adapter = random_adapter(jax.random.key(9), m.cfg, LoraSpec(rank=4, alpha=8, targets=("q", "down")))
    lora.save_peft(adapter, tmp_path / "ok")
    return m, tmp_path / "ok"


def _copy_with(src: pathlib.Path, dst: pathlib.Path, config_update=None, drop_tensor=None) -> pathlib.Path:
    shutil.copytree(src, dst)
    if config_update:
        config = json.loads((dst / "adapter_config.json").read_text())
        config.update(config_update)
        (dst / "adapter_config.json").write_text(json.dumps(config))
    if drop_tensor:
        tensors = load_file(str(dst / "adapter_model.safetensors"))
        del tensors[drop_tensor]
        save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def test_load_peft_rejects_dora(saved_adapter, tmp_path):
    m, ok = saved_adapter
    lora.load_peft(ok, m.cfg)  # the unmodified folder loads
    bad = _copy_with(ok, tmp_path / "dora", config_update={"use_dora": True})
    with pytest.raises(ValueError, match="use_dora"):
        lora.load_peft(bad, m.cfg)


@pytest.mark.parametrize(
    "missing",
    [
        "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight",
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
    ],
)
def test_load_peft_names_a_missing_tensor(saved_adapter, tmp_path, missing):
    m, ok = saved_adapter
    bad = _copy_with(ok, tmp_path / "missing", drop_tensor=missing)
    with pytest.raises(ValueError, match="missing.*" + missing.replace(".", r"\.")):
        lora.load_peft(bad, m.cfg)


def test_load_peft_names_a_wrong_shape(saved_adapter, tmp_path):
    m, ok = saved_adapter
    bad = _copy_with(ok, tmp_path / "rank", config_update={"r": 8})
    with pytest.raises(ValueError, match=r"q_proj\.lora_A\.weight.*shape"):
        lora.load_peft(bad, m.cfg)


def test_unknown_target_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"foo.*q_proj.*k_proj.*v_proj.*o_proj.*gate_proj.*up_proj.*down_proj"):
        LoraSpec(targets=("foo",))
    assert LoraSpec(targets=("q", "down_proj")).targets == ("q_proj", "down_proj")


def test_select_adapter_rejects_no_adapter_index(models):
    m = models("llama")
    stack = lora.init_adapters(jax.random.key(0), m.cfg, LoraSpec(rank=2), 2)
    assert lora.select_adapter(stack, 1).num_adapters == 1
    for bad in (NO_ADAPTER, 2):
        with pytest.raises(ValueError, match="out of range"):
            lora.select_adapter(stack, bad)


# 8. The sampler with a stack of adapters == each row generated alone with its adapter.
def test_sampler_mixed_adapters_equal_each_row_alone(models):
    m = models("llama")
    stack = three_adapters(m.cfg)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [20, 21, 22, 23, 24, 25, 26], [5, 4]]
    kwargs = dict(key=jax.random.key(0), max_new_tokens=7, temperature=0.0)
    options = dict(decode_chunk=4, min_cache=32)
    mixed, _ = Sampler(m.cfg, m.params, adapters=stack, **options).generate(prompts, adapter_idx=MIXED_IDX, **kwargs)
    single = Sampler(m.cfg, m.params, adapters=lora.select_adapter(stack, 0), **options)
    base = Sampler(m.cfg, m.params, **options)
    changed = 0
    worst_logp = 0.0
    for prompt, idx, out in zip(prompts, MIXED_IDX, mixed):
        (base_out,), _ = base.generate([prompt], **kwargs)
        if idx == NO_ADAPTER:
            alone = base_out
        else:
            single.set_adapters(lora.select_adapter(stack, idx))
            (alone,), _ = single.generate([prompt], adapter_idx=0, **kwargs)
            changed += alone.token_ids != base_out.token_ids
        assert len(out.token_ids) == 7
        assert out.token_ids == alone.token_ids, (idx, out.token_ids, alone.token_ids)
        worst_logp = max(worst_logp, max_diff(out.logprobs, alone.logprobs))
    assert worst_logp <= 1e-4, worst_logp
    assert changed >= 2  # the adapters steer greedy decoding, so mixing them up would show
    print(f"\n[lora] sampler mixed vs alone: tokens identical, logprob max |diff| = {worst_logp:.3g}")
