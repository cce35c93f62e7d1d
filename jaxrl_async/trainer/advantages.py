"""Group advantage estimators and KL estimators as small registered pure functions.

Advantage estimators map per-sequence rewards [N] and dense group indices [N] (0..G-1, one group = the
samples of one prompt) to per-sequence advantages [N]; `compute_advantages` accepts arbitrary group ids.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

AdvantageFn = Callable[..., jax.Array]
ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str):
    """Adds `fn(rewards_N, group_N, num_groups, **kw) -> advantages_N` to ADVANTAGES."""

    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} registered twice")
        ADVANTAGES[name] = fn
        return fn

    return wrap


def _group_stats(rewards_N, group_N, num_groups: int):
    """Per-sequence (group size, group mean, group population variance) [N] each."""
    count_G = jax.ops.segment_sum(jnp.ones_like(rewards_N), group_N, num_segments=num_groups)
    mean_G = jax.ops.segment_sum(rewards_N, group_N, num_segments=num_groups) / jnp.maximum(count_G, 1.0)
    mean_N = mean_G[group_N]
    var_G = jax.ops.segment_sum((rewards_N - mean_N) ** 2, group_N, num_segments=num_groups)
    var_G = var_G / jnp.maximum(count_G, 1.0)
    return count_G[group_N], mean_N, var_G[group_N]


@register_advantage("grpo")
def grpo(rewards_N, group_N, num_groups: int, eps: float = 1e-6):
    """GRPO: (r - group mean) / (group std + eps), population std (a group of equal rewards gives 0)."""
    _, mean_N, var_N = _group_stats(rewards_N, group_N, num_groups)
    return (rewards_N - mean_N) / (jnp.sqrt(var_N) + eps)


@register_advantage("dr_grpo")
def dr_grpo(rewards_N, group_N, num_groups: int):
    """Dr.GRPO: r - group mean (no std division, which biases towards easy/hard prompts)."""
    _, mean_N, _ = _group_stats(rewards_N, group_N, num_groups)
    return rewards_N - mean_N


@register_advantage("rloo")
def rloo(rewards_N, group_N, num_groups: int):
    """RLOO: r - mean of the other samples of the group; 0 for a group of one."""
    count_N, mean_N, _ = _group_stats(rewards_N, group_N, num_groups)
    others_mean = (count_N * mean_N - rewards_N) / jnp.maximum(count_N - 1.0, 1.0)
    return jnp.where(count_N > 1, rewards_N - others_mean, 0.0)


def compute_advantages(kind: str, rewards, group_ids, **kw) -> np.ndarray:
    """Per-sequence advantages float32 [N] for rewards [N] and any hashable-int group ids [N]."""
    if kind not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {kind!r}; known: {sorted(ADVANTAGES)}")
    rewards_N = jnp.asarray(np.asarray(rewards, np.float32))
    _, group_N = np.unique(np.asarray(group_ids), return_inverse=True)
    num_groups = int(group_N.max()) + 1 if group_N.size else 0
    out = ADVANTAGES[kind](rewards_N, jnp.asarray(group_N.reshape(-1), jnp.int32), num_groups, **kw)
    return np.asarray(out, np.float32)


KL_ESTIMATORS: dict[str, Callable] = {
    # Schulman's estimators of KL(pi_theta || pi_ref) from samples of pi_theta, r = log pi_ref - log pi.
    "k1": lambda logp, ref_logp: logp - ref_logp,
    "k3": lambda logp, ref_logp: jnp.expm1(ref_logp - logp) - (ref_logp - logp),
}


def kl_estimate(kind: str, logp, ref_logp) -> jax.Array:
    """Per-token KL estimate (k1: unbiased, can be negative; k3: unbiased, non-negative, lower variance)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logp, ref_logp)
