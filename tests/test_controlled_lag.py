"""Controlled lag: the samplers get version v - k, and in a short sync run every token is exactly k stale."""

import os

import jax.numpy as jnp
import pytest

from jaxrl_async.run_config import ConfigError, validate
from jaxrl_async.runtime.lag import LaggedPublisher, lagged
from jaxrl_async.runtime.metrics import read_scalars
from jaxrl_async.runtime.orchestrator import run_from_config
from tests.test_orchestrator import _small


class _Recorder:
    """The publisher interface (publish -> message, last_seconds), recording what it was given."""

    last_seconds = 0.0

    def __init__(self):
        self.sent = []

    def publish(self, version, params):
        self.sent.append((version, float(params["w"])))
        return ("message", version)


def test_lagged_publisher_offers_version_v_minus_k_once_and_the_last_version_as_is():
    inner = _Recorder()
    pub = lagged(inner, 2, final_version=6)
    assert isinstance(pub, LaggedPublisher) and lagged(inner, 0, 6) is inner
    for v in range(7):
        params = {"w": jnp.float32(10 * v)}
        out = pub.publish(v, params)
        params["w"] = jnp.float32(-1)  # the caller's buffers are reused (donated): the copy must not see it
        assert (out is None) == (v in (1, 2))
    # v = 0 -> 0, v = 1, 2 -> nothing new, v = 3..5 -> v - 2 with its own weights, v = 6 (final) -> 6.
    assert inner.sent == [(0, 0.0), (1, 10.0), (2, 20.0), (3, 30.0), (6, 60.0)]
    assert len(pub._kept) == 0
    with pytest.raises(ValueError, match="controlled_lag"):
        LaggedPublisher(inner, 0, 6)


def test_controlled_lag_config_is_validated(tmp_path):
    c = _small(tmp_path, mode="sync", **{"trainer.controlled_lag": 2, "checkpoint_every": 5})
    with pytest.raises(ConfigError, match="config.trainer.controlled_lag"):
        validate(c, 8)
    with pytest.raises(ConfigError, match="config.trainer.minibatches"):
        validate(_small(tmp_path, **{"trainer.minibatches": 5}), 8)


def test_every_trained_token_is_exactly_k_stale_in_a_sync_run(tmp_path):
    k, steps = 2, 5
    overrides = {"trainer.controlled_lag": k, "trainer.minibatches": 2}
    c = _small(tmp_path, mode="sync", total_steps=steps, eval_every=0, checkpoint_every=0,
               checkpoint_minutes=0.0, verify_weights=True, **overrides)  # fmt: skip
    summary = run_from_config(c)
    assert summary["steps"] == steps
    s = read_scalars(os.path.join(tmp_path, "tb"))
    mean, top = dict(s["staleness/token_mean"]), dict(s["staleness/token_max"])
    # Version v trains the batch sampled at version v - 1 by weights max(v - 1 - k, 0); mean == max
    # means every token has that staleness.
    for v in range(1, steps + 1):
        want = min(v - 1, k)
        assert mean[v] == pytest.approx(want) and top[v] == want, (v, mean[v], top[v])
    assert dict(s["train/updates"]) == {v: 2.0 for v in range(1, steps + 1)}
    assert sorted(summary["weight_checksums"]["learner"]) == [0, 1, 2, steps]
