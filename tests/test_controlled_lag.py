"""Controlled lag: the samplers get version v - k, and in a short sync run every token is exactly k stale."""

import os

import jax.numpy as jnp
import pytest

from jaxrl_async.run_config import ConfigError, validate
from jaxrl_async.runtime.lag import LaggedPublisher, lagged, publish_all
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


def test_the_last_version_brings_the_due_versions_the_samplers_skipped_in_order_once():
    inner = _Recorder()
    pub = lagged(inner, 3, final_version=8, due=lambda v: v % 2 == 0 or v == 8)
    sent = []
    for v in range(9):
        sent.append([m[1] for m in publish_all(pub, v, {"w": jnp.float32(10 * v)})])
    # v = 0..7 offer max(v - 3, 0) once; v = 8 first offers the kept, due, not yet offered 6 (5 and 7 are
    # not due; 4 was offered at v = 7), then 8 itself: each with its own weights, in order, none twice.
    assert sent == [[0], [], [], [], [1], [2], [3], [4], [6, 8]]
    assert inner.sent == [(0, 0.0), (1, 10.0), (2, 20.0), (3, 30.0), (4, 40.0), (6, 60.0), (8, 80.0)]
    # Without the lag, one message a version as before.
    assert [m[1] for m in publish_all(_Recorder(), 5, {"w": jnp.float32(0)})] == [5]


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


def test_a_lagged_run_evaluates_the_versions_a_lag_0_run_does_through_the_last(tmp_path):
    """The samplers never hold versions total_steps - k + 1 .. total_steps - 1 for sampling, so before the
    fix version 4 (due: eval_every 2) was never evaluated: a late-run mean over evaluations then averaged
    fewer late (better) versions in a lagged arm than in sync, biasing the comparison against it."""
    k, steps = 2, 5
    c = _small(tmp_path, mode="sync", total_steps=steps, eval_every=2, checkpoint_every=0,
               checkpoint_minutes=0.0, verify_weights=True,
               **{"trainer.controlled_lag": k, "trainer.minibatches": 2})  # fmt: skip
    summary = run_from_config(c)
    evaluated = [e["step"] for e in summary["evals"]]
    assert evaluated == [0, 2, 4, 5]  # every version a lag-0 run evaluates, in order, none twice
    assert summary["evals"][-1]["step"] == steps == summary["steps"]
    # Published in order, each once, and received with the trainer's bytes (verify_weights).
    learner = summary["weight_checksums"]["learner"]
    assert sorted(learner) == [0, 1, 2, 4, steps]  # 3 is neither sampled with (lag 2) nor due
    actor = summary["weight_checksums"]["actors"][0]
    assert {int(v): x for v, x in actor.items()} == {int(v): x for v, x in learner.items()}
    # The drift split in the summary, per lag band: step 1 trains lag-0 tokens, step 2 lag 1, steps 3-5
    # lag 2 (min(v - 1, k)), each step's tokens all in one band.
    drift = summary["drift"]
    assert {b: d["steps"] for b, d in drift.items()} == {"lag0": 1, "lag1": 1, "lag2_3": 3}
    assert all(d["token_frac"] == pytest.approx(1.0) for d in drift.values())
    assert abs(drift["lag0"]["log_ratio"]) < 1e-3  # sampled by the weights that score it: mismatch only
