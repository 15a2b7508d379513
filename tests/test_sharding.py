"""The same forward pass and sampler on 1 device and on meshes of 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from trace_jax import lora
from trace_jax.models.config import ModelConfig
from trace_jax.models.decoder import forward
from trace_jax.models.loading import load_params
from trace_jax.sampling import Sampler
from trace_jax.sharding import ShardingPlan, make_mesh

LAYOUTS = [dict(data=8), dict(data=2, fsdp=2, tensor=2), dict(data=1, fsdp=4, tensor=2)]


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
    path, _ = tiny_checkpoints["qwen3"]
    cfg = ModelConfig.from_dir(path)
    params = load_params(path, cfg)
    adapters = lora.init_adapters(jax.random.key(0), cfg, lora.LoraSpec(rank=4, targets=lora.ALL_TARGETS), 2)
    adapters = lora.Adapters(jax.tree.map(lambda w: w + 0.05, adapters.weights), adapters.scale)
    return cfg, params, adapters


def test_rules_shard_and_fall_back_when_indivisible():
    plan = ShardingPlan(make_mesh(data=2, fsdp=2, tensor=2))
    assert plan.param_sharding("layers/0/q_proj/kernel", (64, 128)).spec == P("fsdp", "tensor")
    assert plan.param_sharding("layers/11/k_proj/kernel", (64, 3)).spec == P("fsdp", None)
    assert plan.param_sharding("layers/0/attn_norm", (64,)).spec == P(None)
    assert plan.activation_sharding("batch", (8,)).spec == P(("data", "fsdp"))
    assert plan.activation_sharding("batch", (2,)).spec == P(None)
    with pytest.raises(ValueError, match="devices exactly"):
        make_mesh(data=3)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "-".join(f"{k}{v}" for k, v in layout.items()))
def test_sharded_logits_and_greedy_samples_equal_single_device(model, layout):
    cfg, params, adapters = model
    plan = ShardingPlan(make_mesh(**layout))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (8, 24)))
    adapter_idx = jnp.asarray([0, 1, -1, 0, 1, -1, 0, 1])
    row_lora = lora.for_rows(adapters, adapter_idx)
    single, _ = forward(params, tokens, cfg, row_lora=row_lora)
    sharded_params = plan.shard_params(params)
    assert any(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(sharded_params))
    fn = jax.jit(lambda p, a, t, i: forward(p, t, cfg, row_lora=lora.for_rows(a, i), constrain=plan.constrain)[0])
    sharded = fn(
        sharded_params,
        plan.shard_params(adapters),
        jax.device_put(tokens, plan.activation_sharding("batch", tokens.shape)),
        adapter_idx,
    )
    assert np.abs(np.asarray(sharded) - np.asarray(single)).max() <= 1e-5

    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11], [12, 13]]
    kwargs = dict(key=jax.random.key(0), max_new_tokens=8, adapter_idx=[0, 1, -1, 0, 1, -1])
    ref, _ = Sampler(cfg, params, adapters=adapters).generate(prompts, **kwargs)
    out, cache = Sampler(cfg, params, adapters=adapters, plan=plan).generate(prompts, **kwargs)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert np.abs(np.array([o.logprobs for o in out]) - np.array([o.logprobs for o in ref])).max() <= 1e-5
    assert cache.batch % plan.batch_multiple == 0
