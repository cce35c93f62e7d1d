"""Objectives for stale data against hand-computed numbers: mask vs truncate, M2PO, ESS, off-policy
sequence masking, and the refusal of loss knobs the chosen loss never reads."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.trainer import TrainConfig
from jaxrl_async.trainer.losses import (
    LossHParams,
    effective_sample_fraction,
    finalize_metrics,
    m2_keep,
    policy_loss,
)


def _row(x):
    return jnp.asarray(np.asarray(x, np.float32)[None])


def _loss(kind, logp, prox, behav, adv, **hp):
    s, c, m = policy_loss(
        kind, _row(logp), _row(prox), _row(behav), _row(adv), jnp.ones((1, len(logp))), **hp
    )
    return float(s), float(c), {k: float(v) for k, v in finalize_metrics(m).items()}


def test_default_is_areal_token_mask_and_truncate_stays_an_option():
    assert LossHParams().behav_mode == "mask" and LossHParams().behav_level == "token"
    assert TrainConfig().behav_mode == "mask" and TrainConfig().dual_clip == 3.0
    # pi_theta = pi_prox (u = 1), behaviour weights w = pi_prox / pi_behav = 1, 2, 8; A = 1 everywhere.
    prox = [-1.0, -1.0, -1.0]
    behav = [-1.0, -1.0 - math.log(2.0), -1.0 - math.log(8.0)]
    adv = [1.0, 1.0, 1.0]
    s, c, m = _loss("decoupled_ppo", prox, prox, behav, adv, behav_mode="truncate", behav_cap=5.0)
    assert s / c == pytest.approx(-(1 + 2 + 5) / 3, rel=1e-5)  # the drifted token weighs most (5)
    assert m["behav_dropped_frac"] == pytest.approx(1 / 3)
    s, c, m = _loss("decoupled_ppo", prox, prox, behav, adv)  # the default: mask at 5
    assert s / c == pytest.approx(-(1 + 2 + 0) / 3, rel=1e-5)  # dropped, and still in the denominator
    assert c == 3 and m["behav_dropped_frac"] == pytest.approx(1 / 3)


def test_m2_keep_drops_the_largest_squared_log_ratios_until_the_mean_is_under_tau():
    log_r = _row([0.1, -0.1, 0.5, 0.0])  # squares 0.01, 0.01, 0.25, 0: mean 0.0675 > 0.04
    np.testing.assert_array_equal(np.asarray(m2_keep(log_r, jnp.ones((1, 4)), 0.04)), [[1, 1, 0, 1]])
    # Under the bound: nothing dropped. Two outliers: both go (dropping one leaves mean 0.0867).
    np.testing.assert_array_equal(np.asarray(m2_keep(log_r, jnp.ones((1, 4)), 0.07)), [[1, 1, 1, 1]])
    two = _row([0.1, -0.6, 0.5, 0.0])
    np.testing.assert_array_equal(np.asarray(m2_keep(two, jnp.ones((1, 4)), 0.04)), [[1, 0, 0, 1]])
    # Padding is neither counted nor dropped.
    mask = _row([1, 1, 0, 1])
    np.testing.assert_array_equal(np.asarray(m2_keep(_row([0.1, 0.1, 9.0, 0.1]), mask, 0.04)), [[1, 1, 1, 1]])


def test_m2po_value_and_gradient():
    behav = np.array([-1.0, -1.0, -1.0, -1.0], np.float32)
    logp = behav + np.array([0.1, -0.1, 0.5, 0.0], np.float32)
    adv = np.array([1.0, -2.0, 3.0, 0.5], np.float32)

    def f(lp):
        s, c, _ = policy_loss("m2po", lp, lp, _row(behav), _row(adv), jnp.ones((1, 4)), m2po_tau=0.04)
        return s / c

    value, grad = jax.value_and_grad(f)(_row(logp))
    r = np.exp(logp - behav)
    keep = np.array([1, 1, 0, 1])
    assert float(value) == pytest.approx(float(-(r * adv * keep).sum() / 4), rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad)[0], -r * adv * keep / 4, rtol=1e-5)  # no clip, no gradient
    _, _, m = _loss("m2po", logp, logp, behav, adv)
    assert m["behav_dropped_frac"] == pytest.approx(0.25) and m["clip_frac"] == 0.0


def test_effective_sample_fraction_is_kish():
    rho = np.array([1.0, 1.0, 4.0])
    m = {
        "rho_sum": jnp.float32(rho.sum()),
        "rho_sq_sum": jnp.float32((rho**2).sum()),
        "tokens": jnp.float32(3),
    }
    assert float(effective_sample_fraction(m)) == pytest.approx(36 / 54, rel=1e-6)
    m = {"rho_sum": jnp.float32(3.0), "rho_sq_sum": jnp.float32(3.0), "tokens": jnp.float32(3)}
    assert float(effective_sample_fraction(m)) == pytest.approx(1.0)  # on-policy


def test_offpolicy_sequence_mask_drops_only_stale_negative_sequences():
    # Three sequences of two tokens (segment ids 1, 2, 3); mean log(pi_behav / pi_theta) 0.5, 0.05, 0.5.
    logp = _row([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    behav = _row([-0.5, -0.5, -0.95, -0.95, -0.5, -0.5])
    adv = _row([-1.0, -1.0, -1.0, -1.0, 1.0, 1.0])
    seg = jnp.asarray([[1, 1, 2, 2, 3, 3]])
    kw = dict(segment_ids=seg, behav_mode="none", eps_high=0.2)
    s0, c0, m0 = policy_loss("ppo", logp, logp, behav, adv, jnp.ones((1, 6)), **kw)
    s1, c1, m1 = policy_loss("ppo", logp, logp, behav, adv, jnp.ones((1, 6)), offpolicy_seq_mask=0.1, **kw)
    assert float(c0) == float(c1) == 6
    assert float(finalize_metrics(m1)["offpolicy_masked_frac"]) == pytest.approx(2 / 6)
    assert float(finalize_metrics(m0)["offpolicy_masked_frac"]) == 0.0
    # Sequence 1's two tokens (ratio exp(-0.5), A = -1, clipped at 0.8: loss 0.8 each) are gone.
    assert float(s0) - float(s1) == pytest.approx(2 * 0.8, rel=1e-5)


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(loss="ppo", behav_mode="truncate"), "behav_mode"),
        (dict(loss="m2po", eps_low=0.1), "eps_low"),
        (dict(loss="decoupled_ppo", m2po_tau=0.1), "m2po_tau"),
        (dict(behav_mode="truncate", behav_floor=0.1), "behav_floor"),
        (dict(constant=4.0), "constant"),
        (dict(loss="ppo", prox_mode="loglinear"), "prox_mode"),
        (dict(dynamic_sampling_patience=3), "dynamic_sampling_patience"),
        (dict(kl_estimator="k1"), "kl_estimator"),
        (dict(controlled_lag=-1), "controlled_lag"),
    ],
)
def test_knobs_that_would_do_nothing_are_refused(bad, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**bad)
    TrainConfig(loss="m2po", m2po_tau=0.1)  # read by its loss: fine
    TrainConfig(aggregation="constant", constant=4.0)


def test_sampler_knobs_that_would_do_nothing_are_refused():
    from jaxrl_async.sampler import SamplerConfig

    with pytest.raises(ValueError, match="top_k"):
        SamplerConfig(temperature=0.0, top_k=5)
    with pytest.raises(ValueError, match="top_p"):
        SamplerConfig(temperature=0.0, top_p=0.9)
    with pytest.raises(ValueError, match="top_p_candidates"):
        SamplerConfig(top_p_candidates=64)
    with pytest.raises(ValueError, match="page_size"):
        SamplerConfig(attention="xla", page_size=8)
    SamplerConfig(temperature=0.7, top_k=5, top_p=0.9, top_p_candidates=64)  # all read
    SamplerConfig(page_size=8)  # "auto" may pick the paged cache
