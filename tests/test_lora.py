"""LoRA (config.trainer.lora): validation naming the field, adapters-only gradients and optimizer state,
a zero-B start at the base's logits, merged == unmerged, adapter-only weight sync, exact resume."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model import forward_logits, init_params, presets
from jaxrl_async.model import lora as lora_lib
from jaxrl_async.rollouts import Rollout
from jaxrl_async.run_config import ConfigError, _section
from jaxrl_async.trainer import TrainConfig, compute_logprobs, create_train_state, prepare_batch, train_step
from jaxrl_async.trainer.adapters import model_params

MODEL = presets.tiny(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffw_size=128)
LORA = lora_lib.LoraConfig(enabled=True, rank=4, alpha=8.0)
BASE = TrainConfig(lr=1e-2, token_budget=48, rows_per_micro=8, minibatches=1, lora=LORA)


@pytest.fixture(scope="module")
def params():
    return init_params(MODEL, jax.random.key(0))


def rollouts(n=16, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, c = int(rng.integers(1, 12)), int(rng.integers(1, 20))
        behav = -4.2 + 0.3 * rng.normal(size=c)
        out.append(Rollout.for_trainer(rng.integers(0, 64, p), rng.integers(0, 64, c), behav, [0] * c,
                                       float(rng.integers(0, 2)), i // 4))  # fmt: skip
    return out


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize(
    "lora, field",
    [
        (dict(enabled=True, rank=0), "config.trainer.lora.rank"),
        (dict(enabled=True, targets=("q", "qkv_proj")), "config.trainer.lora.targets"),
        (dict(enabled=True, init="kaiming"), "config.trainer.lora.init"),
        (dict(enabled=True, rnak=4), "config.trainer.lora.rnak"),
    ],
)
def test_bad_lora_config_fails_naming_the_field(lora, field):
    with pytest.raises(ConfigError, match=field):
        _section("trainer", TrainConfig, {"lora": lora})


def test_rank_larger_than_a_target_fails_before_compiling(params):
    cfg = dataclasses.replace(BASE, lora=dataclasses.replace(LORA, rank=40, targets=("k",)))  # k: 64 -> 32
    with pytest.raises(ValueError, match=r"config.trainer.lora.rank=40 exceeds target 'k'"):
        create_train_state(cfg, MODEL, params)


def test_default_is_full_fine_tuning(params):
    state = create_train_state(TrainConfig(token_budget=48, rows_per_micro=8, minibatches=1), MODEL, params)
    assert state.frozen is None
    assert jax.tree.structure(state.params) == jax.tree.structure(params)


def test_only_adapters_get_gradients_and_optimizer_state(params):
    full = create_train_state(dataclasses.replace(BASE, lora=lora_lib.LoraConfig()), MODEL, params)
    state = create_train_state(BASE, MODEL, params)
    adapters = lora_lib.adapter_specs(MODEL, LORA)
    assert jax.tree.structure(state.params) == jax.tree.structure(
        jax.tree.map(lambda s: 0, adapters, is_leaf=lambda x: isinstance(x, lora_lib.ParamSpec))
    )
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    assert all(x.dtype == jnp.dtype(MODEL.dtype) for x in jax.tree.leaves(state.frozen))
    # AdamW's two moments over the adapters alone (plus scalar counts): 2x the adapter bytes.
    adapter_bytes = lora_lib.adapter_bytes(MODEL, LORA)
    assert nbytes(state.params) == adapter_bytes
    moment_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moment_bytes == 2 * adapter_bytes
    full_moments = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(full.opt_state) if x.ndim)
    assert full_moments == 2 * nbytes(params) and moment_bytes < full_moments / 10
    frozen_before = jax.tree.map(np.asarray, state.frozen)
    a_before = jax.tree.map(np.asarray, state.params)
    # With B = 0, A's gradient is 0 at the first step (it flows through B): the second moves A too.
    for seed in (0, 1):
        state, m = train_step(state, prepare_batch(BASE, rollouts(seed=seed)))
        assert int(m["updates"]) == 1
    for x, y in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(state.frozen), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))  # the base never moves
    before, after = jax.tree.leaves(a_before), jax.tree.leaves(state.params)
    moved = [not np.array_equal(x, np.asarray(y)) for x, y in zip(before, after, strict=True)]
    assert all(moved)  # every adapter leaf (A and B) got a gradient and a step


def test_zero_b_starts_at_the_base_logits_exactly(params):
    state = create_train_state(BASE, MODEL, params)
    batch = prepare_batch(BASE, rollouts())
    full = create_train_state(dataclasses.replace(BASE, lora=lora_lib.LoraConfig()), MODEL, params)
    np.testing.assert_array_equal(compute_logprobs(state, batch), compute_logprobs(full, batch))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 9)), jnp.int32)
    combined = model_params(BASE, state.params, state.frozen)
    np.testing.assert_array_equal(
        np.asarray(forward_logits(MODEL, combined, tokens)), np.asarray(forward_logits(MODEL, params, tokens))
    )


def test_merged_equals_unmerged(params):
    lora = dataclasses.replace(LORA, init="normal")  # B != 0: a real update
    adapters = lora_lib.init_adapters(MODEL, lora, jax.random.key(3))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (3, 11)), jnp.int32)
    unmerged = np.asarray(forward_logits(MODEL, lora_lib.combine(params, adapters, lora), tokens))
    merged = np.asarray(forward_logits(MODEL, lora_lib.merge(params, adapters, lora), tokens))
    base = np.asarray(forward_logits(MODEL, params, tokens))
    assert np.abs(unmerged - base).max() > 1e-2  # the adapters change the logits
    np.testing.assert_allclose(merged, unmerged, rtol=1e-4, atol=1e-4)


def test_a_synced_version_moves_only_adapter_bytes_and_the_receiver_checks_them(params):
    from jaxrl_async.runtime.lora_sync import LoraWeights, WeightsMismatch, tree_bytes
    from jaxrl_async.runtime.messages import NewWeights
    from jaxrl_async.runtime.weight_sync import LocalWeights, WeightSync, checksum
    from jaxrl_async.sharding import make_mesh

    state = create_train_state(BASE, MODEL, params)
    state, _ = train_step(state, prepare_batch(BASE, rollouts()))  # B != 0 now
    s_mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[1:2])
    weights = LoraWeights(MODEL, LORA, s_mesh, state.frozen, verify=True, apply="merge")
    assert weights.base_bytes == nbytes(params)  # the base moved once, at start
    sent = weights.publish(1, state.params)
    assert weights.last_bytes == lora_lib.adapter_bytes(MODEL, LORA, MODEL.dtype) == nbytes(state.params)
    full = LocalWeights(WeightSync(MODEL, s_mesh), verify=True).publish(1, params)
    assert tree_bytes(full.params) == nbytes(params) > 10 * weights.last_bytes
    got = weights.finish(weights.start(sent))
    assert list(weights.checked) == [1] and weights.checked[1] == pytest.approx(sent.checksum, rel=1e-6)
    want = lora_lib.merge(state.frozen, state.params, LORA)
    np.testing.assert_allclose(checksum(got), checksum(want), rtol=1e-6)
    assert all(x.sharding.device_set == set(jax.devices()[1:2]) for x in jax.tree.leaves(got))
    corrupt = NewWeights(2, sent.params, sent.checksum + 1.0)
    with pytest.raises(WeightsMismatch, match="version 2"):
        weights.receive(corrupt)


def test_unmerged_receiver_hands_the_same_base_arrays_every_version(params):
    from jaxrl_async.runtime.lora_sync import LoraWeights
    from jaxrl_async.sharding import make_mesh

    state = create_train_state(BASE, MODEL, params)
    s_mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[1:2])
    weights = LoraWeights(MODEL, LORA, s_mesh, state.frozen)
    first, second = (weights.receive(weights.publish(v, state.params)) for v in (1, 2))
    assert first["layers"]["q"] is second["layers"]["q"] is weights.base["layers"]["q"]
    assert "q_lora_a" in second["layers"]  # what an unmerged engine (Engine(lora=...)) takes
