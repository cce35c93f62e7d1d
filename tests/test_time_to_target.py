"""benchmarks.time_to_target: seed-averaged curves, interpolated crossings, censoring, the speedup split."""

import math

import pytest

from benchmarks.time_to_target import crossing, line, study


def _run(step_s: float, slope: float, start: float = 0.3, every: int = 10, steps: int = 100) -> dict:
    return {"evals": [{"step": k, "trained_s": k * step_s, "accuracy": start + slope * k}
                      for k in range(0, steps + 1, every)]}  # fmt: skip


def test_the_speedup_is_the_steps_per_second_ratio_times_the_steps_ratio():
    # Async steps take 0.8 s against sync's 1.0 s, and need 0.8 of sync's steps (it learns 1.25x faster
    # per step): speedup 1.25 x 1.25. The target sits between evaluations: the crossing is interpolated.
    sync = {s: _run(1.0, 0.004) for s in range(3)}
    asyn = {s: _run(0.8, 0.005) for s in range(3)}
    r = study(sync, asyn, frac=0.33, boot=200)
    assert r["target"] == pytest.approx(0.3 + 0.33 * 0.4)
    assert r["sync_steps"] == pytest.approx(33.0, rel=1e-3)
    assert r["async_steps"] == pytest.approx(26.4, rel=1e-3)
    assert r["steps_ratio"] == pytest.approx(1.25, rel=1e-3)
    assert r["rate_ratio"] == pytest.approx(1.25, rel=1e-3)
    assert r["speedup"] == pytest.approx(r["steps_ratio"] * r["rate_ratio"], rel=1e-9)
    assert r["speedup_ci95"][0] == pytest.approx(1.5625, rel=1e-3) == r["speedup_ci95"][1]  # identical seeds
    assert r["censored_frac"] == 0 and "speedup 1.56" in line(r)


def test_a_seed_that_never_reaches_the_target_is_counted_not_dropped():
    sync = {s: _run(1.0, 0.004) for s in range(4)}
    reaching = {s: _run(1.0, 0.004) for s in range(3)}
    with_flat = {**reaching, 3: _run(1.0, 0.0)}  # async seed 3 never learns
    kept = study(sync, with_flat, boot=300, seed=1)
    assert kept["async_s"] > study({s: sync[s] for s in range(3)}, reaching, boot=10)["async_s"] + 10
    assert math.isinf(kept["speedup_ci95"][0]) is False and kept["speedup_ci95"][0] < kept["speedup"] < 1
    assert 0 < kept["censored_frac"] < 1  # resamples heavy in seed 3 never cross: censored, not forgotten


def test_crossing_interpolates_and_says_never():
    assert crossing([0.0, 10.0, 20.0], [0.1, 0.3, 0.5], 0.4) == pytest.approx(15.0)
    assert crossing([0.0, 10.0], [0.5, 0.6], 0.4) == 0.0
    assert crossing([0.0, 10.0], [0.1, 0.2], 0.4) == math.inf
    with pytest.raises(ValueError, match="at least 2 paired seeds"):
        study({0: _run(1.0, 0.004)}, {0: _run(1.0, 0.004)})
