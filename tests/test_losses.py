"""Policy losses against hand-computed numbers, and exact (sum, count) aggregation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.trainer.losses import LOSSES, combine_metrics, finalize_metrics, policy_loss

LN = math.log
# The goldens below were computed with symmetric clipping and no behaviour weight unless a test says
# otherwise (LossHParams's defaults are clip-higher 0.28 and a truncated behaviour weight).
GOLDEN_HP = dict(eps_high=0.2, behav_mode="none")


def _loss(kind, logp, prox, behav, adv, mask=None, **hp):
    hp = {**GOLDEN_HP, **hp}
    arr = lambda x: jnp.asarray(np.asarray(x, np.float32).reshape(len(x), -1) if np.ndim(x) == 2 else [x])
    logp, prox, behav, adv = (arr(x) for x in (logp, prox, behav, adv))
    mask = jnp.ones_like(logp) if mask is None else arr(mask)
    s, c, m = policy_loss(kind, logp, prox, behav, adv, mask, **hp)
    return float(s), float(c), {k: np.asarray(v) for k, v in finalize_metrics(m).items()}


@pytest.mark.parametrize("kind", ["decoupled_ppo", "ppo", "gspo"])
def test_ratio_one_gives_minus_mean_advantage(kind):
    adv = [0.5, -2.0, 1.25, 3.0]
    s, c, m = _loss(kind, [-1.0, -0.3, -2.0, -0.7], [-1.0, -0.3, -2.0, -0.7], [-1.0, -0.3, -2.0, -0.7], adv)
    assert s / c == pytest.approx(-np.mean(adv), abs=1e-6)
    assert c == 4 and m["clip_frac"] == 0 and m["is_weight_mean"] == pytest.approx(1.0)


def test_clipped_branches_and_dual_clip():
    # (u, A) per token: (1.5, +1) clipped to 1.2; (0.5, +1) unclipped; (0.5, -1) clipped to 0.8;
    # (1.5, -1) unclipped
    u = np.array([1.5, 0.5, 0.5, 1.5])
    adv = [1.0, 1.0, -1.0, -1.0]
    logp = np.log(u) - 1.0
    prox = np.full(4, -1.0)
    hp = dict(eps_low=0.2, eps_high=0.2)
    s, c, m = _loss("decoupled_ppo", logp, prox, prox, adv, **hp)
    assert s == pytest.approx(-1.2 - 0.5 + 0.8 + 1.5, abs=1e-5) and c == 4
    assert m["clip_frac"] == pytest.approx(0.5)
    # token 0 is clipped above (A > 0, u > 1.2), token 2 below (A < 0, u < 0.8)
    assert m["clip_high_frac"] == pytest.approx(0.25) and m["clip_low_frac"] == pytest.approx(0.25)
    s, _, m = _loss("decoupled_ppo", logp, prox, prox, adv, dual_clip=1.3, **hp)
    assert s == pytest.approx(-1.2 - 0.5 + 0.8 + 1.3, abs=1e-5)
    assert m["dual_clip_frac"] == pytest.approx(0.25)
    # clip-higher: eps_high=0.6 lets the first token's ratio through.
    s, _, _ = _loss("decoupled_ppo", logp, prox, prox, adv, eps_low=0.2, eps_high=0.6)
    assert s == pytest.approx(-1.5 - 0.5 + 0.8 + 1.5, abs=1e-5)


def test_clipped_tokens_have_no_gradient():
    u = jnp.array([[1.5, 0.5, 0.5, 1.5]])
    adv = jnp.array([[1.0, 1.0, -1.0, -1.0]])
    prox = jnp.full((1, 4), -1.0)

    def f(logp):
        s, c, _ = policy_loss(
            "decoupled_ppo", logp, prox, prox, adv, jnp.ones((1, 4)), eps_low=0.2, eps_high=0.2
        )
        return s / c

    g = jax.grad(f)(jnp.log(u) - 1.0)
    np.testing.assert_allclose(g, [[0.0, -0.5 / 4, 0.0, 1.5 / 4]], atol=1e-6)


def test_behaviour_weight_truncate_and_mask_token_level():
    # ratio u = 1; w = pi_prox / pi_behav = [10, 2]; A = 1 -> token losses -w
    prox = [-1.0, -1.0]
    behav = [-1.0 - LN(10.0), -1.0 - LN(2.0)]
    adv = [1.0, 1.0]
    s, c, m = _loss("decoupled_ppo", prox, prox, behav, adv, behav_mode="none")
    assert s == pytest.approx(-2.0) and m["is_weight_max"] == pytest.approx(10.0, rel=1e-5)
    assert m["is_weight_mean"] == pytest.approx(6.0, rel=1e-5)
    s, c, m = _loss("decoupled_ppo", prox, prox, behav, adv, behav_mode="truncate", behav_cap=5.0)
    assert s == pytest.approx(-7.0, rel=1e-5) and c == 2 and m["behav_dropped_frac"] == pytest.approx(0.5)
    s, c, m = _loss("decoupled_ppo", prox, prox, behav, adv, behav_mode="mask", behav_cap=5.0)
    assert s == pytest.approx(-2.0, rel=1e-5) and c == 2 and m["behav_dropped_frac"] == pytest.approx(0.5)
    s, _, _ = _loss(
        "decoupled_ppo", prox, prox, behav, adv, behav_mode="mask", behav_cap=50.0, behav_floor=3.0
    )
    assert s == pytest.approx(-10.0, rel=1e-5)


def test_behaviour_weight_sequence_level():
    # row 0: w = [2, 8] -> geometric mean 4 (under the cap); row 1: w = [8, 8] -> 8 (over the cap)
    prox = np.full((2, 2), -1.0)
    behav = prox - np.log([[2.0, 8.0], [8.0, 8.0]])
    adv = np.ones((2, 2))
    seq = dict(behav_level="sequence", behav_cap=5.0)
    s, _, _ = _loss("decoupled_ppo", prox, prox, behav, adv, behav_mode="truncate", **seq)
    assert s == pytest.approx(-(4 + 4 + 5 + 5), rel=1e-5)
    s, _, m = _loss("decoupled_ppo", prox, prox, behav, adv, behav_mode="mask", **seq)
    assert s == pytest.approx(-(4 + 4), rel=1e-5) and m["behav_dropped_frac"] == pytest.approx(0.5)
    s, _, _ = _loss("decoupled_ppo", prox, prox, behav, adv, behav_mode="truncate", behav_cap=5.0)
    assert s == pytest.approx(-(2 + 5 + 5 + 5), rel=1e-5)  # token level for contrast


def test_gspo_uses_the_sequence_geometric_mean_ratio():
    # log ratios [ln 2, 0] -> s = sqrt(2) ~ 1.414, clipped to 1.2 for A > 0
    logp = np.array([[LN(2.0) - 1.0, -1.0]])
    prox = np.full((1, 2), -1.0)
    s, c, m = _loss("gspo", logp, prox, prox, np.ones((1, 2)), eps_low=0.2, eps_high=0.2)
    assert s / c == pytest.approx(-1.2, rel=1e-5) and m["clip_frac"] == 1.0
    s, c, _ = _loss("gspo", logp, prox, prox, -np.ones((1, 2)), eps_low=0.2, eps_high=0.2)
    assert s / c == pytest.approx(math.sqrt(2.0), rel=1e-5)


def test_reinforce_tis_value_and_gradient():
    # ratio pi / pi_behav = e^0.5 ~ 1.65 truncated at 1 + eps_high = 1.2; second token ratio 1
    logp = jnp.array([[-1.0, -2.0]])
    behav = jnp.array([[-1.5, -2.0]])
    adv = jnp.array([[2.0, 1.0]])

    def f(lp):
        s, c, _ = policy_loss("reinforce_tis", lp, behav, behav, adv, jnp.ones((1, 2)), eps_high=0.2)
        return s / c

    assert float(f(logp)) == pytest.approx((1.0 * 2.0 * 1.2 + 2.0 * 1.0 * 1.0) / 2, rel=1e-6)
    np.testing.assert_allclose(jax.grad(f)(logp), [[-2.0 * 1.2 / 2, -1.0 / 2]], rtol=1e-6)


def test_aggregations():
    # sequences of 1 and 3 tokens (row 0 padded), ratio 1, A = +1 and -1 -> token losses -1 and +1
    mask = np.array([[1, 0, 0], [1, 1, 1]], np.float32)
    adv = np.array([[1.0, 9.0, 9.0], [-1.0, -1.0, -1.0]])
    z = np.zeros((2, 3))
    s, c, _ = _loss("ppo", z, z, z, adv, mask, aggregation="token_mean")
    assert (s, c) == (pytest.approx(2.0), 4)
    s, c, _ = _loss("ppo", z, z, z, adv, mask, aggregation="seq_mean")
    assert (s, c) == (pytest.approx(0.0), 2)
    s, c, _ = _loss("ppo", z, z, z, adv, mask, aggregation="constant", constant=4.0)
    assert (s, c) == (pytest.approx(0.5), 2)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "constant"])
@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_packed_rows_and_micro_batches_aggregate_exactly(kind, aggregation):
    rng = np.random.default_rng(0)
    lengths = [3, 5, 2, 4]
    f = lambda n: rng.normal(size=n).astype(np.float32) * 0.3
    seqs = [(f(n) - 1, f(n) - 1, f(n) - 1, f(1).repeat(n) * 3) for n in lengths]
    hp = dict(
        aggregation=aggregation, constant=7.0, behav_mode="truncate", behav_cap=1.1, behav_level="sequence"
    )
    # Unpacked: one sequence a row, right-padded; micro-batches = two halves.
    t = max(lengths)
    pad = lambda x: np.pad(x, (0, t - len(x)))
    unpacked = [np.stack([pad(s[j]) for s in seqs]) for j in range(4)]
    mask = np.stack([pad(np.ones(n, np.float32)) for n in lengths])
    whole = policy_loss(kind, *unpacked, mask, **hp)
    halves = [
        policy_loss(kind, *(u[sl] for u in unpacked), mask[sl], **hp) for sl in (slice(0, 2), slice(2, 4))
    ]
    # Packed: all four sequences in one row with segment ids 1..4 and a padding tail.
    row = [np.concatenate([s[j] for s in seqs] + [np.zeros(2, np.float32)])[None] for j in range(4)]
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(2)])[None].astype(
        np.int32
    )
    packed = policy_loss(kind, *row, (seg > 0).astype(np.float32), segment_ids=seg, **hp)
    for got in (packed, (halves[0][0] + halves[1][0], halves[0][1] + halves[1][1], None)):
        assert float(got[0]) == pytest.approx(float(whole[0]), rel=1e-5)
        assert float(got[1]) == float(whole[1])
    merged = combine_metrics(halves[0][2], halves[1][2])
    for k, v in whole[2].items():
        assert float(merged[k]) == pytest.approx(float(v), rel=1e-5), k
        assert float(packed[2][k]) == pytest.approx(float(v), rel=1e-5), k


def test_rejects_bad_arguments():
    z = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="unknown loss"):
        policy_loss("nope", z, z, z, z, z)
    with pytest.raises(ValueError, match="behav_mode"):
        policy_loss("ppo", z, z, z, z, z, behav_mode="clamp")
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss("ppo", z, z, z, z, z, dual_clip=0.5)
    with pytest.raises(TypeError):
        policy_loss("ppo", z, z, z, z, z, epsilon=0.1)


def test_loss_specs_say_which_losses_read_prox_and_stats_are_checked():
    from jaxrl_async.trainer.losses import LOSS_SPECS, LOSSES, reads_prox, register_loss

    assert set(LOSS_SPECS) == set(LOSSES)
    assert {k for k in LOSSES if not reads_prox(k)} == {"ppo", "reinforce_tis", "m2po"}
    z = jnp.zeros((1, 2))
    for kind in LOSSES:  # every built-in returns exactly the declared stats
        policy_loss(kind, z, z, z, z, jnp.ones((1, 2)))

    @register_loss("_test_partial_stats", reads_prox=False)
    def partial(logp, prox, behav, adv, segs, hp):
        return -logp * adv, {"clip": jnp.zeros_like(logp)}

    try:
        assert not reads_prox("_test_partial_stats")
        with pytest.raises(ValueError, match="returned stats"):
            policy_loss("_test_partial_stats", z, z, z, z, jnp.ones((1, 2)))
        with pytest.raises(ValueError, match="registered twice"):
            register_loss("_test_partial_stats")(partial)
    finally:
        LOSSES.pop("_test_partial_stats")
        LOSS_SPECS.pop("_test_partial_stats")
