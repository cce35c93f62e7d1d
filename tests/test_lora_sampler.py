"""LoRA in the sampler: merged (W + (alpha/r)·A·B once per version) and unmerged ((x·A)·B in every
matmul, SamplerConfig.lora_apply) decode the same logits as the model's forward, engine and decode path."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model import forward_logits, init_params, presets
from jaxrl_async.model import lora as lora_lib
from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop, decode, layout
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

TINY = presets.tiny(vocab_size=64, n_layers=2, max_seq_len=64, qkv_bias=True, qk_norm=True)
MESH1 = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
LORA = lora_lib.LoraConfig(enabled=True, rank=4, alpha=8.0, init="normal")


@pytest.fixture(scope="module")
def weights():
    base = init_params(TINY, jax.random.key(0), MESH1, SAMPLER_RULES)
    base = jax.tree.map(lambda x: x * 1.5 if x.ndim >= 2 else x, base)  # sharper logits for greedy checks
    adapters = lora_lib.init_adapters(TINY, LORA, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x * 3.0, adapters)  # an update large enough to change greedy tokens
    return base, adapters


@pytest.mark.parametrize("fuse", [False, True])
def test_decode_merged_equals_unmerged_equals_forward(weights, fuse):
    base, adapters = jax.device_get(weights)
    tokens = np.random.default_rng(5).integers(0, TINY.vocab_size, (2, 10)).astype(np.int32)
    full = np.asarray(forward_logits(TINY, lora_lib.combine(base, adapters, LORA), tokens))
    assert np.abs(full - np.asarray(forward_logits(TINY, base, tokens))).max() > 0.1
    step = jax.jit(functools.partial(decode.decode_step, TINY, attention="xla"))
    layouts = {
        "merge": layout.to_decode_layout(TINY, lora_lib.merge(base, adapters, LORA), fuse),
        "unmerged": layout.to_decode_layout(TINY, lora_lib.combine(base, adapters, LORA), fuse, lora=LORA),
    }
    for dparams in layouts.values():
        keys, values = decode.prefill_kv(TINY, dparams, jnp.asarray(tokens[:, :6]))
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 10), (0, 0)))
        keys, values = [pad(k) for k in keys], [pad(v) for v in values]
        lens = np.array([6, 6], np.int32)
        for _ in range(4):
            logits, keys, values = step(dparams, keys, values, tokens[:, lens[0]], lens)
            np.testing.assert_allclose(np.asarray(logits), full[:, lens[0]], atol=2e-5, rtol=1e-5)
            lens = lens + 1


def _run(engine, prompts):
    loop = SamplerLoop(engine)
    for i, p in enumerate(prompts):
        loop.add_request(Request(i, p, n_samples=1, seed=i))
    return {c.uid: c for c in loop.run()}


def test_engines_merged_and_unmerged_sample_alike_and_update_adapters_only(weights):
    base, adapters = weights
    scfg = dict(num_slots=4, max_prompt_len=16, max_new_tokens=8, steps_per_call=4, temperature=0.0,
                attention="xla", linear="xla")  # fmt: skip
    merged = Engine(TINY, lora_lib.merge(base, adapters, LORA), MESH1, SamplerConfig(**scfg))
    # The unmerged engine starts from zero adapters (the base) and then takes only the adapters.
    zero = jax.tree.map(jnp.zeros_like, adapters)
    unmerged = Engine(TINY, lora_lib.combine(base, zero, LORA), MESH1,
                      SamplerConfig(**scfg, lora_apply="unmerged"), lora=LORA)  # fmt: skip
    base_leaf = unmerged.decode_params["layers"][0]["qkv"]
    unmerged.update_adapters(adapters, version=3)
    assert unmerged.version == 3 and unmerged.decode_params["layers"][0]["qkv"] is base_leaf
    # What a run does (runtime/lora_sync.py): the same base arrays beside each version's adapters; the
    # engine sees the base it laid out last and lays out only the adapters.
    unmerged.update_params(lora_lib.combine(base, adapters, LORA), version=4)
    assert unmerged.version == 4 and unmerged.decode_params["layers"][0]["qkv"] is base_leaf
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY.vocab_size, size=int(rng.integers(2, 16))).tolist() for _ in range(6)]
    a, b = _run(merged, prompts), _run(unmerged, prompts)
    assert a.keys() == b.keys()
    for uid in a:
        np.testing.assert_array_equal(a[uid].tokens, b[uid].tokens)
        np.testing.assert_allclose(a[uid].logprobs, b[uid].logprobs, atol=2e-5)
    with pytest.raises(ValueError, match="update_adapters needs an engine built with lora"):
        merged.update_adapters(adapters, 4)
    assert dataclasses.replace(LORA).scale == 2.0
