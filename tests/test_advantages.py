"""Group advantage estimators and KL estimators against hand-computed values."""

import math

import numpy as np
import pytest

from jaxrl_async.trainer.advantages import ADVANTAGES, compute_advantages, kl_estimate

# Groups with arbitrary ids: {1, 0, 0, 1} (mean 0.5, std 0.5), {3, 5} (mean 4, std 1) and a singleton.
REWARDS = [1.0, 3.0, 0.0, 0.0, 5.0, 1.0, 7.0]
GROUPS = [42, 7, 42, 42, 7, 42, -1]


def test_grpo_normalizes_by_group_mean_and_std():
    adv = compute_advantages("grpo", REWARDS, GROUPS)
    np.testing.assert_allclose(adv, [1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 0.0], atol=1e-5)


def test_dr_grpo_subtracts_the_group_mean_only():
    adv = compute_advantages("dr_grpo", REWARDS, GROUPS)
    np.testing.assert_allclose(adv, [0.5, -1.0, -0.5, -0.5, 1.0, 0.5, 0.0], atol=1e-6)


def test_rloo_leaves_one_out():
    adv = compute_advantages("rloo", REWARDS, GROUPS)
    # group 42: r - mean(others), e.g. 1 - (0 + 0 + 1) / 3 = 2/3; group 7: 3 - 5 = -2; singleton: 0
    np.testing.assert_allclose(adv, [2 / 3, -2.0, -2 / 3, -2 / 3, 2.0, 2 / 3, 0.0], atol=1e-6)


def test_equal_rewards_give_zero_advantage():
    for kind in ADVANTAGES:
        np.testing.assert_allclose(compute_advantages(kind, [1.0, 1.0, 1.0], [0, 0, 0]), 0.0, atol=1e-6)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages("ppo_gae", [1.0], [0])


def test_kl_estimators():
    logp, ref = np.array([-1.0, -2.0]), np.array([-1.0, -1.5])
    np.testing.assert_allclose(kl_estimate("k1", logp, ref), [0.0, -0.5], atol=1e-7)
    np.testing.assert_allclose(kl_estimate("k3", logp, ref), [0.0, math.exp(0.5) - 1 - 0.5], rtol=1e-6)
    with pytest.raises(ValueError, match="unknown KL"):
        kl_estimate("k2x", logp, ref)
