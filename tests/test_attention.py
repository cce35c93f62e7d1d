"""Attention implementations match the reference on packed rows: outputs, loss and gradients, prefill.

"splash" runs here in Pallas interpret mode (the TPU kernel's own code, interpreted on CPU); "dot_product"
runs jax.nn.dot_product_attention's XLA implementation (cuDNN needs a GPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model import attention, init_params, presets
from jaxrl_async.rollouts import Rollout
from jaxrl_async.sampler import decode, layout
from jaxrl_async.sharding import make_mesh
from jaxrl_async.trainer import TrainConfig, create_train_state, loss_and_grads, prepare_batch

sample = Rollout.for_trainer  # the run's record, built as the trainer reads it

FAST = ("dot_product", "splash")
MODEL = presets.tiny(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffw_size=128)


def _packed_row(rng, b=2, t=160, h=4, g=2, k=16):
    q = jnp.asarray(rng.standard_normal((b, t, h, k)), jnp.float32)
    kv = [jnp.asarray(rng.standard_normal((b, t, g, k)), jnp.float32) for _ in range(2)]
    seg = np.zeros((b, t), np.int32)
    for row in range(b):  # a few segments of random length, then padding
        start, sid = 0, 1
        while start < t - 20:
            n = int(rng.integers(5, 60))
            seg[row, start : start + n] = sid
            start, sid = start + n, sid + 1
        seg[row, min(start, t) :] = 0
    return q, kv[0], kv[1], jnp.asarray(seg)


@pytest.mark.parametrize("impl", FAST)
def test_attention_matches_the_reference_on_packed_rows(impl):
    q, k, v, seg = _packed_row(np.random.default_rng(0))
    real = np.asarray(seg > 0)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32) * real[..., None, None]

    def loss(name, q, k, v):
        return jnp.sum(attention.attend(name, q, k, v, seg) * w)

    out, ref = attention.attend(impl, q, k, v, seg), attention.attend("reference", q, k, v, seg)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=2e-5, rtol=1e-5)
    grads = jax.grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(lambda *a: loss("reference", *a), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-5, rtol=1e-4)
    # One sequence per row (segment_ids=None) is plain causal attention.
    np.testing.assert_allclose(
        np.asarray(attention.attend(impl, q, k, v)),
        np.asarray(attention.attend("reference", q, k, v)),
        atol=2e-5,
        rtol=1e-5,
    )


def _rollouts(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(10):
        p, c = int(rng.integers(2, 10)), int(rng.integers(3, 30))
        out.append(
            sample(
                rng.integers(0, 64, p),
                rng.integers(0, 64, c),
                -4.0 + 0.3 * rng.normal(size=c),
                [0] * c,
                float(i % 3 == 0),
                i // 5,
            )
        )
    return out


@pytest.mark.parametrize("impl", FAST)
def test_train_loss_and_gradients_match_the_reference(impl):
    """The trainer's packed micro-batches (several sequences a row) through the whole model."""
    cfg = TrainConfig(token_budget=96, rows_per_micro=2, minibatches=1)
    params = init_params(MODEL, jax.random.key(0))
    batch = prepare_batch(cfg, _rollouts())
    assert int(np.max(batch.arrays["segment_ids"])) > 1  # rows really are packed
    ref = loss_and_grads(create_train_state(cfg, MODEL, params), batch)
    got = loss_and_grads(create_train_state(cfg, MODEL.replace(attention=impl), params), batch)
    assert float(got[0]) == pytest.approx(float(ref[0]), rel=1e-5, abs=1e-6)
    for g, r in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-6, rtol=2e-4)


def test_sharded_splash_runs_per_device_and_matches_the_reference():
    """On a (fsdp 2, tensor 2) trainer mesh splash runs under shard_map: rows and KV heads stay split."""
    cfg = TrainConfig(token_budget=96, rows_per_micro=2, minibatches=1)
    params = init_params(MODEL, jax.random.key(1))
    mesh = make_mesh((2, 2), ("fsdp", "tensor"), jax.devices()[:4])
    batch = prepare_batch(cfg, _rollouts(seed=3))
    ref = loss_and_grads(create_train_state(cfg, MODEL, params), batch)
    got = loss_and_grads(create_train_state(cfg, MODEL.replace(attention="splash"), params, mesh), batch)
    assert float(got[0]) == pytest.approx(float(ref[0]), rel=1e-5, abs=1e-6)
    for g, r in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-6, rtol=2e-4)


@pytest.mark.parametrize("impl", FAST)
def test_prefill_keys_and_values_match_the_reference(impl):
    params = init_params(MODEL, jax.random.key(2))
    dparams = layout.to_decode_layout(MODEL, params, fuse=True)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, 24)), jnp.int32)
    ref_k, ref_v = decode.prefill_kv(MODEL, dparams, tokens)
    got_k, got_v = decode.prefill_kv(MODEL.replace(attention=impl), dparams, tokens)
    for g, r in zip(got_k + got_v, ref_k + ref_v, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=1e-5)


def test_auto_picks_by_platform_and_unknown_names_fail():
    assert attention.resolve("auto", "cpu") == "reference"
    assert attention.resolve("auto", "gpu") == "dot_product"
    assert attention.resolve("auto", "tpu") == "splash"
    assert attention.resolve("splash", "cpu") == "splash"
    with pytest.raises(ValueError, match="attention"):
        attention.resolve("flash")
