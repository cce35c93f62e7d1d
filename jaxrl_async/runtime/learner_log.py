"""What the learner reports and when it saves: per-step TensorBoard values and rates (`StepLog`), the
trainer's clocks (`StepClock`), the actors' reports (`ActorReports`), the checkpoint cadence
(`SavePolicy`) and the run summary's steady rates. Pure bookkeeping: nothing here touches the device, the
transport or another role, so each piece is unit-tested on its own."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import numpy as np

from jaxrl_async.rollouts import Rollout, uninformative
from jaxrl_async.trainer.train_step import DRIFT_BANDS

RATE_WINDOW = 10  # steps over which perf/* rates are taken (perf/*_avg: since the start)
RATE_KEYS = ("train_tokens_per_s", "sample_tokens_per_s", "sampler_idle_frac", "trainer_idle_frac")
# A rate taken per another running total than the learner's elapsed seconds, when `totals` has it: the
# samplers' idle seconds per second of their own clocks (`ActorStats.wall_s`; their reports arrive late).
RATE_PER = {"sampler_idle_frac": "sampler_wall_s"}

SUMMARY_KEYS = (
    "reward/mean",
    "eval/accuracy",
    "loss/policy",
    "staleness/mean",
    "staleness/max",
    "staleness/token_mean",
    "perf/train_tokens_per_s",
    "perf/weight_sync_s",
)

# Train-step metric (as the losses return it) -> TensorBoard tag.
_TRAIN_TAGS = {
    "loss": "loss/policy",
    "is_weight_mean": "is_weight/mean",
    "is_weight_max": "is_weight/max",
    "clip_frac": "train/clip_frac",
    "clip_low_frac": "train/clip_low_frac",
    "clip_high_frac": "train/clip_high_frac",
    "dual_clip_frac": "train/dual_clip_frac",
    "behav_dropped_frac": "train/behav_dropped_frac",
    "kl_ref_mean": "train/kl_ref",
    "kl_behav_mean": "train/kl_behav",
    "grad_norm": "train/grad_norm",
    "updates": "train/updates",  # optimizer updates applied this step (trainer.minibatches)
    "ess_frac": "train/ess",
    "offpolicy_masked_frac": "train/offpolicy_masked_frac",
    "entropy_mean": "train/entropy",
    "zero_adv_skipped_frac": "train/zero_adv_skipped_frac",
}


def train_values(metrics: dict[str, float]) -> dict[str, float | None]:
    """The train step's scalars under their TensorBoard tags (None where this loss has no such metric)."""
    return {tag: metrics.get(key) for key, tag in _TRAIN_TAGS.items()}


def drift_values(metrics: dict[str, float]) -> dict[str, float]:
    """The drift split (docs/train.md, "Reading drift"): per lag band of the train step's tokens, the mean
    of log(pi_theta / pi_behav) (`drift/log_ratio/<band>`), the fraction whose ratio is above the behaviour
    cap (`drift/over_cap_frac/<band>`) and the band's share of the loss tokens (`drift/token_frac/<band>`).
    Band lag0 is the sampler/trainer mismatch alone. A band with no tokens this step is left out."""
    out = {}
    total = sum(metrics.get(f"drift_{name}_count", 0.0) for name, _, _ in DRIFT_BANDS)
    for name, _, _ in DRIFT_BANDS:
        n = metrics.get(f"drift_{name}_count", 0.0)
        if n > 0:
            out[f"drift/log_ratio/{name}"] = metrics[f"drift_{name}_log_ratio_total"] / n
            out[f"drift/over_cap_frac/{name}"] = metrics[f"drift_{name}_over_cap_count"] / n
            out[f"drift/token_frac/{name}"] = n / total
    return out


def staleness_values(st: dict[str, Any], dropped_groups: int) -> dict[str, float]:
    """`rollouts.staleness_stats` of a batch as TensorBoard values."""
    return {
        "staleness/mean": st["head_mean"],
        "staleness/max": float(st["head_max"]),
        "staleness/token_mean": st["token_mean"],
        "staleness/token_max": float(st["token_max"]),
        "staleness/mixed_frac": st["mixed_frac"],
        "staleness/dropped_groups": float(dropped_groups),
    }


def completion_values(groups: list[list[Rollout]]) -> dict[str, float]:
    """Rewards and completion lengths of a batch."""
    rollouts = [r for g in groups for r in g]
    lengths = [len(r.completion_tokens) for r in rollouts]
    return {
        "reward/mean": float(np.mean([r.reward for r in rollouts])),
        "reward/overlong_penalty": float(np.mean([r.metadata.get("overlong_penalty", 0.0)
                                                  for r in rollouts])),  # fmt: skip
        "completion/truncated_frac": float(np.mean([r.finish_reason == "length" for r in rollouts])),
        "train/uninformative_group_frac": float(np.mean([uninformative(g) for g in groups])),
        "completion/length_mean": float(np.mean(lengths)),
        "completion/length_max": float(np.max(lengths)),
    }


class StepLog:
    """Per-step values: rates over a window, TensorBoard output, and the history the summary reads.

    Args:
      writer: the run's MetricsWriter (the learner lead is its only user).
      text_samples: completions written as text at each step.
    """

    def __init__(self, writer, text_samples: int):
        self.writer, self.text_samples = writer, text_samples
        self.history: list[dict[str, float]] = []
        self.lengths: collections.Counter[int] = collections.Counter()  # trained completion length -> count
        self._totals: list[tuple[float, dict[str, float]]] = [(0.0, {k: 0.0 for k in RATE_KEYS})]

    def rates(self, elapsed: float, totals: dict[str, float]) -> dict[str, float]:
        """perf/* rates from the run's running `totals` (keys RATE_KEYS: tokens, idle seconds) over the
        last RATE_WINDOW steps (what the run does now), and since the start as perf/*_avg (the run average
        climbs for a while after compilation and hides later slowdowns)."""
        self._totals.append((elapsed, dict(totals)))
        t0, start = self._totals[max(0, len(self._totals) - 1 - RATE_WINDOW)]
        out = {}
        windowed = len(self._totals) > 1
        for k, v in totals.items():
            if k in RATE_PER.values():
                continue
            per = RATE_PER.get(k)
            if per in totals:
                span, whole = totals[per] - start.get(per, 0.0), totals[per]
            else:
                span, whole = elapsed - t0, elapsed
            out[f"perf/{k}"] = (v - start.get(k, 0.0)) / max(span, 1e-9) if windowed else v / max(whole, 1e-9)
            out[f"perf/{k}_avg"] = v / max(whole, 1e-9)
        return out

    def record(self, version: int, values: dict[str, float | None], st: dict[str, Any],
               groups: list[list[Rollout]], times: dict[str, float]) -> dict[str, float | None]:  # fmt: skip
        """Writes one step: `values` as scalars, the staleness and length histograms, sample texts; keeps
        `values` plus `times` (time/* totals, not written) in the history. Returns what it kept."""
        rollouts = [r for g in groups for r in g]
        w = self.writer
        w.scalars(version, values)
        w.histogram(version, "staleness/head", st["head_values"])
        w.histogram(version, "staleness/token", st["token_values"])
        lengths = [len(r.completion_tokens) for r in rollouts]
        self.lengths.update(lengths)
        w.histogram(version, "completion/length", lengths)
        for r in rollouts[: self.text_samples]:
            text = f"reward {r.reward:.2f} | {r.metadata['prompt']!r} -> {r.metadata['text']!r}"
            if r.model_mask is not None:  # a whole episode: its turns and the observations between them
                text = f"{r.metadata.get('turns', 1)} turns, ended {r.finish_reason} | {text}"
            w.text(version, "samples", text)
        values = {**values, **times}
        self.history.append({k: v for k, v in values.items() if v is not None})
        return values

    def length_quantiles(self) -> dict[str, float | None]:
        """Mean, median, 99th percentile and longest length in tokens of every completion the recorded
        steps held (the run's own completions: how long-tailed its workload was), None before any step."""
        keys = ("completion_length_mean", "completion_length_p50", "completion_length_p99",
                "completion_length_max")  # fmt: skip
        if not self.lengths:
            return dict.fromkeys(keys)
        values = np.repeat(np.fromiter(self.lengths.keys(), int), np.fromiter(self.lengths.values(), int))
        p50, p99 = np.percentile(values, [50, 99])
        return dict(zip(keys, map(float, (values.mean(), p50, p99, values.max())), strict=True))

    def mean(self, key: str) -> float:
        """Mean of `key` over the steps that have it (0 before any step)."""
        found = [h[key] for h in self.history if key in h]
        return float(np.mean(found)) if found else 0.0


def steady_rate(hist: list[dict[str, float]], key: str = "time/trained_tokens",
                per: str = "time/elapsed_s") -> float:  # fmt: skip
    """Growth of `key` per growth of `per` (the learner's seconds) after the first fifth of the steps (at
    least 2), which excludes compilation and fill-up: trained tokens/s, or with an idle-seconds key and
    the seconds of the same clock the idle fraction."""
    k = max(2, len(hist) // 5)
    if len(hist) <= k:
        return 0.0
    a, b = hist[k - 1], hist[-1]
    return (b[key] - a[key]) / max(b[per] - a[per], 1e-9)


@dataclasses.dataclass
class SavePolicy:
    """When the learner checkpoints: every `every` versions and/or every `minutes`, never the last version
    (the final save covers it). A save does not wait for the version's evaluation (that would idle the
    trainer): a checkpoint carries its accuracy only when the evaluation has already finished.

    Attributes:
      every: versions between checkpoints (0 = by time only).
      minutes: wall minutes between checkpoints (0 = by versions only).
      total_steps: the run's last version.
      saved_at: time.monotonic() of the last save (the run's start before any).
    """

    every: int
    minutes: float
    total_steps: int
    saved_at: float

    def due(self, version: int, now: float) -> bool:
        """Whether to save after training `version`, at time `now`."""
        by_steps = bool(self.every and version % self.every == 0)
        by_time = bool(self.minutes and now - self.saved_at > 60 * self.minutes)
        return version < self.total_steps and (by_steps or by_time)


class StepClock:
    """The learner's clocks: seconds since the start, the trainer's idle seconds (no train step in flight)
    and each train step's span, (version, dispatched, finished) in time.monotonic (the summary's
    `step_spans`, which evaluations' spans are set against)."""

    def __init__(self):
        self.started = time.perf_counter()
        self.started_mono = time.monotonic()  # the clock of `spans`
        self.idle_s = 0.0
        self.spans: list[tuple[int, float, float]] = []
        self._idle_since = self.started
        self._dispatched = self.started_mono

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def dispatch(self) -> float:
        """A train step starts: the trainer's idle time ends. Returns time.perf_counter() (its start)."""
        now = time.perf_counter()
        self.idle_s += now - self._idle_since
        self._dispatched = time.monotonic()
        return now

    def trained(self, version: int) -> None:
        """The step that made `version` finished (its span ends now)."""
        self.spans.append((version, self._dispatched, time.monotonic()))

    def idle(self) -> None:
        """The trainer has nothing in flight from now."""
        self._idle_since = time.perf_counter()


class ActorReports:
    """What the actors reported: each one's latest `ActorStats`, which of them have drained (their last
    report said they had nothing left to do), and their final (`Stopped`) reports.

    Args:
      actors: how many actors the run has.
    """

    def __init__(self, actors: int):
        self.actors = actors
        self.latest: dict[int, Any] = {}  # actor -> its latest ActorStats
        self.final: dict[int, Any] = {}  # actor -> its Stopped report
        self._drained: set[int] = set()

    def update(self, actor: int, stats, final: bool = False) -> None:
        if final:
            self.final[actor] = stats
        self.latest[actor] = stats
        if stats.drained:
            self._drained.add(actor)
        else:
            self._drained.discard(actor)

    def work_coming(self) -> None:
        """Groups went back to the coordinator (filtered or dropped): the actors will have work again."""
        self._drained.clear()

    @property
    def all_drained(self) -> bool:
        return len(self._drained) == self.actors

    @property
    def all_stopped(self) -> bool:
        return len(self.final) == self.actors

    def total(self, key: str) -> float:
        """`key` of the latest reports, summed over the actors."""
        return float(sum(getattr(s, key) for s in self.latest.values()))
