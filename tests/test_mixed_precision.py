"""Mixed precision: float32 master weights and optimizer state, bfloat16 compute, a bf16 sampler copy."""

import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes
import numpy as np
import pytest

from configs import base, math_8b, qwen_1p5b_math
from jaxrl_async.model import from_hf_config, init_params, presets
from jaxrl_async.rollouts import Rollout
from jaxrl_async.run_config import ConfigError, validate
from jaxrl_async.runtime.weight_sync import WeightSync
from jaxrl_async.sampler import Engine, SamplerConfig
from jaxrl_async.sharding import make_mesh
from jaxrl_async.trainer import TrainConfig, create_train_state, prepare_batch, train_step

MODEL = presets.tiny(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffw_size=128)
MIXED = MODEL.replace(dtype="bfloat16", param_dtype="float32")
CFG = TrainConfig(lr=1e-6, token_budget=48, rows_per_micro=4, weight_decay=0.0, minibatches=1)


def _rollouts(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return [
        sample(
            rng.integers(0, 64, 6),
            rng.integers(0, 64, 10),
            -4.0 + 0.1 * rng.normal(size=10),
            [0] * 10,
            float(i % 2),
            i // 4,
        )
        for i in range(n)
    ]


def _changed_fraction(before, after) -> float:
    return float(np.mean(np.asarray(before, np.float32) != np.asarray(after, np.float32)))


def test_lr_1e6_moves_fp32_masters_and_the_sampler_gets_their_bf16_cast():
    params = init_params(MIXED, jax.random.key(0))
    state = create_train_state(CFG, MIXED, params)
    q_before = np.asarray(state.params["layers"]["q"])
    opt_leaves = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params) + opt_leaves)
    state, m = train_step(state, prepare_batch(CFG, _rollouts()))
    assert int(m["skipped"]) == 0
    assert _changed_fraction(q_before, state.params["layers"]["q"]) > 0.9

    # The same step on bf16 masters: an update of ~lr = 1e-6 is below half a bf16 ulp of almost every
    # weight (the ulp of 0.01 is 6e-5), so the weights stay where they were.
    bf16 = MIXED.replace(param_dtype="bfloat16")
    bstate = create_train_state(CFG, bf16, init_params(bf16, jax.random.key(0)))
    bq_before = np.asarray(bstate.params["layers"]["q"])
    bstate, _ = train_step(bstate, prepare_batch(CFG, _rollouts()))
    assert _changed_fraction(bq_before, bstate.params["layers"]["q"]) < 0.01

    sampler_mesh = make_mesh((2, 1), ("data", "tensor"), jax.devices()[4:6])
    sync = WeightSync(MIXED, sampler_mesh, dtype="bfloat16")
    copy = sync(state.params)
    for got, master in zip(jax.tree.leaves(copy), jax.tree.leaves(state.params), strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(master).astype(ml_dtypes.bfloat16))
    assert sync.sampler_cfg.param_dtype == "bfloat16" and sync.sampler_cfg.dtype == "bfloat16"
    scfg = SamplerConfig(num_slots=2, max_prompt_len=8, max_new_tokens=4)
    Engine(sync.sampler_cfg, copy, sampler_mesh, scfg)  # validates the copy against the bf16 layout
    with pytest.raises(ValueError, match="dtype"):
        Engine(MIXED, copy, sampler_mesh, scfg)


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_sampler_copy_survives_the_donating_train_step_on_shared_devices(dtype):
    """Colocated roles: the sampler's copy must not alias the parameters the train step donates."""
    mesh = make_mesh((1, 1), ("fsdp", "tensor"), jax.devices()[:1])
    sampler_mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    state = create_train_state(CFG, MODEL, init_params(MODEL, jax.random.key(1)), mesh)
    copy = WeightSync(MODEL, sampler_mesh, dtype=dtype)(state.params)
    pointer = lambda x: x.addressable_shards[0].data.unsafe_buffer_pointer()
    for got, master in zip(jax.tree.leaves(copy), jax.tree.leaves(state.params), strict=True):
        assert pointer(got) != pointer(master)  # a plain device_put would return the same buffer here
    before = np.asarray(copy["layers"]["q"])
    state, _ = train_step(state, prepare_batch(CFG, _rollouts()))
    np.testing.assert_array_equal(np.asarray(copy["layers"]["q"]), before)
    with pytest.raises(ValueError, match="dtype"):
        WeightSync(MODEL, sampler_mesh, dtype="float16")


def test_hf_config_keeps_fp32_masters_by_default():
    hf = dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    cfg = from_hf_config(hf, dtype="bfloat16")
    assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "float32")
    assert cfg.compute_copy().param_dtype == "bfloat16"
    assert from_hf_config(hf, dtype="bfloat16", param_dtype="bfloat16").param_dtype == "bfloat16"


@pytest.mark.parametrize("get", [math_8b.get_config, qwen_1p5b_math.get_config])
def test_real_model_configs_train_fp32_masters_in_bf16_with_minibatches_and_long_rows(get):
    c = get()
    assert (c.model.dtype, c.model.param_dtype) == ("bfloat16", "float32")
    assert c.trainer.minibatches > 1  # AReaL's ppo_n_minibatches: pi_prox differs from pi_theta
    # Long context: a trainer row holds the longest sequence the sampler can produce.
    assert c.sampler.max_new_tokens >= 16384
    assert c.trainer.token_budget >= c.sampler.max_prompt_len + c.sampler.max_new_tokens


@pytest.mark.parametrize(
    "field, value", [("param_dtype", "float16"), ("dtype", "fp8"), ("attention", "flash")]
)
def test_model_numerics_are_validated_naming_the_field(tmp_path, field, value):
    c: ml_collections.ConfigDict = base.get_config()
    c.workdir = str(tmp_path)
    c.model[field] = value
    with pytest.raises(ConfigError, match=f"config.model.{field}"):
        validate(c)
    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        MODEL.replace(**{field: value})


sample = Rollout.for_trainer  # the run's record, built as the trainer reads it
