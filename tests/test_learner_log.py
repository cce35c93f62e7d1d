"""The learner's bookkeeping, unit by unit: the group filter (dynamic sampling), the non-finite step count,
the save policy, the step log's rates, the trainer's clock and the actors' reports. Each is pure, so these
run without a model or a run."""

import time
import types

import numpy as np
import pytest

from jaxrl_async.rollouts import GroupFilter, NonFiniteSteps, Rollout, uninformative
from jaxrl_async.runtime.learner_log import (
    ActorReports,
    SavePolicy,
    StepClock,
    StepLog,
    completion_values,
    steady_rate,
)


def _group(gid: int, rewards, length: int = 3) -> list[Rollout]:
    tokens, zeros = np.full(length, 3), np.zeros(length)
    return [Rollout("u", gid, i, np.asarray([1, 2]), tokens, zeros, zeros.astype(int), float(r), "stop",
                    {"prompt": "p", "text": "t"})
            for i, r in enumerate(rewards)]  # fmt: skip


def test_uninformative_means_all_rewards_equal():
    assert uninformative(_group(0, [1.0, 1.0])) and uninformative(_group(0, [0.0, 0.0, 0.0]))
    assert not uninformative(_group(0, [0.0, 1.0]))


def test_group_filter_discards_counts_and_runs_out_of_patience():
    f = GroupFilter(enabled=True, patience_groups=3)
    kept, filtered = f.split([_group(0, [0, 1]), _group(1, [1, 1]), _group(2, [0, 0])])
    assert [g[0].group_id for g in kept] == [0] and filtered == [1, 2]
    assert f.in_a_row == 2 and not f.exhausted
    assert f.step_values() == {"dynamic_sampling/yield": 1 / 3, "dynamic_sampling/filtered_groups": 2.0}
    assert f.step_values()["dynamic_sampling/yield"] == 1.0  # a new window: nothing seen yet
    f.split([_group(3, [1, 1])])
    assert f.exhausted and f.filtered_total == 3
    f.split([_group(4, [0, 1])])
    assert not f.exhausted  # a kept group resets the count


def test_group_filter_off_keeps_everything_and_reports_nothing():
    f = GroupFilter(enabled=False, patience_groups=1)
    kept, filtered = f.split([_group(0, [1, 1]), _group(1, [0, 1])])
    assert len(kept) == 2 and filtered == [] and not f.exhausted and f.step_values() == {}


def test_save_policy_by_steps_and_by_time_never_the_last_version():
    p = SavePolicy(every=2, minutes=0.0, total_steps=10, saved_at=0.0)
    assert [v for v in range(1, 11) if p.due(v, 0.0)] == [2, 4, 6, 8]  # 10: the final save covers it
    timed = SavePolicy(every=0, minutes=1.0, total_steps=10, saved_at=100.0)
    assert not timed.due(3, 159.0) and timed.due(3, 161.0) and not timed.due(10, 161.0)


class _Writer:
    def __init__(self):
        self.scalars_at, self.texts = [], []

    def scalars(self, step, values):
        self.scalars_at.append(step)

    def histogram(self, step, tag, values):
        pass

    def text(self, step, tag, text):
        self.texts.append(text)


def test_step_log_rates_over_the_window_and_since_the_start():
    log = StepLog(_Writer(), text_samples=1)
    keys = ("train_tokens_per_s", "sample_tokens_per_s", "sampler_idle_frac", "trainer_idle_frac")
    first = log.rates(2.0, dict.fromkeys(keys, 100.0))
    assert first["perf/train_tokens_per_s"] == 50.0 and first["perf/train_tokens_per_s_avg"] == 50.0
    for t in range(3, 20):  # 100 tokens per second from now on
        out = log.rates(float(t), dict.fromkeys(keys, 100.0 + 100.0 * (t - 2)))
    assert out["perf/train_tokens_per_s"] == pytest.approx(100.0)  # the last 10 steps
    assert out["perf/train_tokens_per_s_avg"] == pytest.approx(1800.0 / 19)


def test_step_log_records_history_and_writes_one_step():
    w = _Writer()
    log = StepLog(w, text_samples=1)
    groups = [_group(0, [0.0, 1.0], length=4)]
    st = {"head_values": [0, 0], "token_values": [0] * 8}
    values = {**completion_values(groups), "loss/policy": None}
    kept = log.record(5, values, st, groups, {"time/elapsed_s": 1.0})
    assert w.scalars_at == [5] and len(w.texts) == 1 and kept["reward/mean"] == 0.5
    assert "loss/policy" not in log.history[0] and log.mean("reward/mean") == 0.5 and log.mean("x") == 0.0


def test_step_log_length_quantiles_pool_every_step():
    log = StepLog(_Writer(), text_samples=0)
    assert set(log.length_quantiles().values()) == {None}
    st = {"head_values": [0], "token_values": [0]}
    for length in (2,) * 98 + (40, 50):  # one completion per step: the quantiles pool the steps
        groups = [_group(0, [1.0], length=length)]
        log.record(0, completion_values(groups), st, groups, {"time/elapsed_s": 1.0})
    q = log.length_quantiles()
    assert q["completion_length_p50"] == 2.0 and q["completion_length_p99"] == pytest.approx(40.1)
    assert q["completion_length_mean"] == pytest.approx((2 * 98 + 40 + 50) / 100)
    assert q["completion_length_max"] == 50.0


def test_steady_rate_skips_the_first_fifth():
    hist = [{"time/elapsed_s": float(t), "time/trained_tokens": float(t * t)} for t in range(1, 11)]
    assert steady_rate(hist) == pytest.approx((100 - 4) / (10 - 2))
    assert steady_rate(hist[:2]) == 0.0
    assert np.isfinite(steady_rate(hist, "time/trained_tokens"))


def test_sampler_idle_fraction_is_taken_on_the_samplers_clock():
    """A report can carry idle time from before the learner's window (an actor reports only when it sends
    groups): per second of the actor's own clock the fraction stays within [0, 1]."""
    # The actor idled 40 s, told only at the step-3 report; the learner's window is 3 s long.
    hist = [{"time/elapsed_s": e, "time/sampler_idle_s": i, "time/sampler_wall_s": w}
            for e, i, w in [(60.0, 0.0, 5.0), (61.5, 0.0, 5.0), (63.0, 40.0, 48.0), (64.5, 40.5, 50.0)]]
    assert steady_rate(hist, "time/sampler_idle_s") > 1  # on the learner's clock: impossible
    assert steady_rate(hist, "time/sampler_idle_s", "time/sampler_wall_s") == pytest.approx(40.5 / 45)
    log = StepLog(_Writer(), text_samples=0)
    keys = ("train_tokens_per_s", "sample_tokens_per_s", "trainer_idle_frac")
    for e, i, w in [(60.0, 0.0, 5.0), (63.0, 40.0, 48.0)]:
        out = log.rates(e, {**dict.fromkeys(keys, 1.0), "sampler_idle_frac": i, "sampler_wall_s": w})
    assert out["perf/sampler_idle_frac"] == out["perf/sampler_idle_frac_avg"] == pytest.approx(40 / 48)
    assert "perf/sampler_wall_s" not in out


def test_non_finite_steps_count_in_a_row_and_stop_at_the_limit():
    n = NonFiniteSteps(limit=2)
    n.record(finite=False)
    assert (n.total, n.in_a_row, n.stop) == (1, 1, False)
    n.record(finite=True)  # a step that changed the weights starts the count again
    assert (n.total, n.in_a_row) == (1, 0)
    n.record(finite=False)
    n.record(finite=False)
    assert (n.total, n.in_a_row, n.stop) == (3, 2, True)


def test_step_clock_counts_idle_time_only_between_steps():
    clock = StepClock()
    time.sleep(0.02)
    started = clock.dispatch()  # idle from the start to the first dispatch
    idle = clock.idle_s
    assert 0.02 <= idle <= started - clock.started + 1e-9
    time.sleep(0.02)  # a step in flight is not idle
    clock.trained(1)
    clock.idle()
    assert clock.idle_s == idle
    (version, dispatched, finished), = clock.spans
    assert version == 1 and finished - dispatched >= 0.02
    time.sleep(0.01)
    clock.dispatch()
    assert clock.idle_s >= idle + 0.01


def test_actor_reports_track_drained_actors_and_final_reports():
    def stats(drained, tokens):
        return types.SimpleNamespace(drained=drained, sample_tokens=tokens)

    r = ActorReports(actors=2)
    r.update(0, stats(True, 5))
    assert not r.all_drained
    r.update(1, stats(True, 7))
    assert r.all_drained and r.total("sample_tokens") == 12.0
    r.work_coming()  # groups went back to the coordinator: both will sample again
    assert not r.all_drained
    r.update(0, stats(False, 9), final=True)
    assert not r.all_stopped and r.total("sample_tokens") == 16.0
    r.update(1, stats(True, 7), final=True)
    assert r.all_stopped and set(r.final) == {0, 1}
