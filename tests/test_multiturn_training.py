"""Multi-turn episodes as training data: observation tokens (`Rollout.model_mask` False) carry no loss
weight, no behaviour logprob, no version and no advantage; packed == unpacked with a mask; the loss,
its gradient and the per-token statistics do not see them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model import forward, init_params, presets, token_logprobs
from jaxrl_async.rollouts import OBSERVATION_VERSION, Rollout
from jaxrl_async.trainer import (
    TrainConfig,
    compute_advantages,
    create_train_state,
    loss_and_grads,
    pack_rollouts,
    pad_rollouts,
    policy_loss,
    prepare_batch,
)

MODEL = presets.tiny(vocab_size=64, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, ffw_size=64)
CFG = TrainConfig(lr=1e-2, token_budget=64, rows_per_micro=4, behav_mode="truncate", minibatches=1)


def episode(rng, group_id: int, version: int = 0) -> Rollout:
    """A prompt, then model turns and observations alternating (each 1-6 tokens)."""
    prompt = rng.integers(0, 64, int(rng.integers(1, 6)))
    tokens, mask = [], []
    for turn in range(int(rng.integers(1, 4))):
        if turn:
            obs = int(rng.integers(1, 6))
            tokens += rng.integers(0, 64, obs).tolist()
            mask += [False] * obs
        n = int(rng.integers(1, 6))
        tokens += rng.integers(0, 64, n).tolist()
        mask += [True] * n
    mask = np.asarray(mask)
    behav = np.where(mask, -4.0 + 0.3 * rng.normal(size=mask.size), 0.0).astype(np.float32)
    versions = np.where(mask, version, OBSERVATION_VERSION).astype(np.int32)
    return Rollout("", group_id, 0, prompt.astype(np.int32), np.asarray(tokens, np.int32), behav, versions,
                   reward=float(rng.integers(0, 2)), model_mask=mask)  # fmt: skip


def episodes(n=12, seed=0):
    rng = np.random.default_rng(seed)
    return [episode(rng, i // 3) for i in range(n)]


@pytest.fixture(scope="module")
def params():
    return init_params(MODEL, jax.random.key(0))


def test_observation_tokens_have_no_loss_weight_logprob_version_or_advantage():
    r = episodes(1, seed=3)[0]
    while r.model_mask.all():
        r = episode(np.random.default_rng(int(r.completion_tokens.sum())), 0)
    a = pad_rollouts([r], [1.5]).micro_batch(0)
    p = len(r.prompt_tokens) - 1  # the row position whose target is the first completion token
    targets = slice(p, p + len(r.completion_tokens))
    np.testing.assert_array_equal(a["targets"][0, targets], r.completion_tokens)
    np.testing.assert_array_equal(a["loss_mask"][0, targets], r.model_mask.astype(np.float32))
    obs = ~r.model_mask
    for field in ("behav_logp", "versions", "advantages"):
        assert np.all(a[field][0, targets][obs] == 0), field
    np.testing.assert_allclose(a["advantages"][0, targets][~obs], 1.5)
    np.testing.assert_array_equal(a["behav_logp"][0, targets][~obs], r.behav_logprobs[~obs])
    assert pack_rollouts([r], [1.5], 64).num_loss_tokens == int(r.model_mask.sum())


def test_a_mask_of_the_wrong_length_is_refused():
    r = episodes(1)[0]
    r = dataclasses.replace(r, model_mask=np.ones(len(r.completion_tokens) + 1, bool))
    with pytest.raises(ValueError, match="model_mask"):
        pack_rollouts([r, r], [0.0, 0.0], 64)


def reference_loss(cfg, params, rollouts):
    """One sequence a row, no segment ids, plain jax.grad (independent of packing)."""
    adv = compute_advantages(cfg.advantage, [r.reward for r in rollouts], [r.group_id for r in rollouts])
    a = pad_rollouts(rollouts, adv, rows_per_micro=len(rollouts)).micro_batch(0)
    pos = jnp.broadcast_to(jnp.arange(a["tokens"].shape[1]), a["tokens"].shape)

    def f(p):
        logp, _ = token_logprobs(forward(MODEL, p, jnp.asarray(a["tokens"]), pos), jnp.asarray(a["targets"]))
        s, c, _ = policy_loss(cfg.loss, logp, jax.lax.stop_gradient(logp), a["behav_logp"], a["advantages"],
                              a["loss_mask"], **cfg.loss_hparams())  # fmt: skip
        return s / c

    return jax.jit(jax.value_and_grad(f))(params)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_packed_equals_unpacked_with_a_mask(params, aggregation):
    rollouts = episodes()
    assert sum(int((~r.model_mask).sum()) for r in rollouts) > 0
    cfg = dataclasses.replace(CFG, aggregation=aggregation)
    ref_loss, ref_grads = reference_loss(cfg, params, rollouts)
    batch = prepare_batch(cfg, rollouts)
    loss, grads, metrics = loss_and_grads(create_train_state(cfg, MODEL, params), batch)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-4, abs=1e-6)
    for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-6)
    assert float(metrics["tokens"]) == sum(int(r.model_mask.sum()) for r in rollouts) == batch.num_loss_tokens


def test_what_observation_tokens_carry_changes_nothing(params):
    """Garbage in an observation's logprob and version slots (NaN, a far version) leaves the loss, the
    gradient and the staleness and KL statistics as they were."""
    rollouts = episodes(seed=1)
    cfg = dataclasses.replace(CFG, kl_coef=0.0)
    state = create_train_state(cfg, MODEL, params)
    base = loss_and_grads(state, prepare_batch(cfg, rollouts))
    garbage = lambda r, x, bad: np.where(r.model_mask, x, bad).astype(x.dtype)
    noisy = [
        dataclasses.replace(
            r, behav_logprobs=garbage(r, r.behav_logprobs, np.nan), versions=garbage(r, r.versions, 10_000)
        )
        for r in rollouts
    ]
    other = loss_and_grads(state, prepare_batch(cfg, noisy))
    assert float(other[0]) == float(base[0])
    for x, y in zip(jax.tree.leaves(other[1]), jax.tree.leaves(base[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for k in ("staleness_max", "staleness_mean", "kl_behav_mean", "is_weight_max", "entropy_mean"):
        assert float(other[2][k]) == float(base[2][k]), k


def test_an_all_model_mask_is_the_single_turn_batch():
    rollouts = episodes(seed=2)
    plain = [dataclasses.replace(r, model_mask=None) for r in rollouts]
    every = [dataclasses.replace(r, model_mask=np.ones(len(r.completion_tokens), bool)) for r in rollouts]
    a, b = prepare_batch(CFG, plain), prepare_batch(CFG, every)
    for k in a.arrays:
        np.testing.assert_array_equal(a.arrays[k], b.arrays[k])
