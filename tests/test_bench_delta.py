"""benchmarks/bench_delta.py counts the sampler-dtype values a version changes: none at rate 0, more at a
larger rate, and a delta's bytes follow from the count."""

from benchmarks.bench_delta import measure


def test_changed_values_follow_the_learning_rate():
    out = measure("tiny", [0.0, 1e-6, 1e-3], steps=2, batch=1, seq=8, dtype="bfloat16")
    rates = out["rates"]
    assert rates["0.0"]["changed_frac"] == [0.0, 0.0]
    low, high = rates["1e-06"]["median_changed_frac"], rates["0.001"]["median_changed_frac"]
    assert 0.0 < low < high <= 1.0
    assert abs(rates["0.001"]["delta_over_full"] - high * 3) < 1e-9  # (4-byte index + 2-byte value) / 2
