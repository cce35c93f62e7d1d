"""Analytic performance model: rates, staleness and throughput of every sampler/trainer split.

See docs/performance-model.md for the derivation of each formula.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl_async.perf.system import System


@dataclasses.dataclass(frozen=True)
class SplitResult:
    """Analytic prediction for one split (or for sync RL when `mode == "sync"`).

    Attributes:
      mode: "async" or "sync".
      sampler_devices, trainer_devices: the split (sync: both are all devices, time-shared).
      replicas: sampler replicas.
      sample_rate: samples/s the sampler produces with all slots busy (its capacity).
      train_rate: samples/s the trainer consumes when never starved.
      window_rate: samples/s the staleness window allows (inf when it never binds).
      samples_per_s, tokens_per_s: predicted throughput (response tokens consumed by the trainer).
      train_step_s: trainer time per step (async: with the weight sync's seconds per version).
      sync_s: the weight sync's seconds per version over the system's link (0 for sync RL: colocated).
      period_s: time between versions (N / samples_per_s).
      decode_batch: mean busy slots per replica.
      max_staleness: longest sample's age in versions at training time.
      mean_staleness: closed-form mean head staleness.
      bottleneck: "sampler", "trainer" or "staleness".
      imbalance: 1 - min(sample_rate, train_rate) / max(sample_rate, train_rate).
      feasible: passes the staleness and balance filters (and memory).
      reason: why not feasible ("" when feasible).
    """

    mode: str
    sampler_devices: int
    trainer_devices: int
    replicas: int
    sample_rate: float
    train_rate: float
    window_rate: float
    samples_per_s: float
    tokens_per_s: float
    train_step_s: float
    period_s: float
    decode_batch: float
    max_staleness: float
    mean_staleness: float
    bottleneck: str
    imbalance: float
    sync_s: float = 0.0
    feasible: bool = True
    reason: str = ""
    within_max_staleness: bool = True
    fits: bool = True

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in d.items()}


def _survival(lengths: np.ndarray) -> np.ndarray:
    """S[s-1] = fraction of samples still decoding at step s (length >= s), s = 1..max."""
    counts = np.bincount(lengths, minlength=int(lengths.max()) + 1)[1:]
    return (len(lengths) - np.cumsum(counts) + counts) / len(lengths)


def batch_generation_s(system: System, replicas: int, n_samples: int) -> tuple[float, float]:
    """Time to decode one batch of n samples on `replicas` replicas to its longest sample (sync-style).

    Returns (seconds, mean decode batch). Each replica gets n/replicas samples; while more are waiting
    than there are slots it decodes at full batch, then it drains the last slots down the survival
    curve of the batch's lengths (the long tail is paid here).
    """
    sp, wl = system.sampler, system.workload
    per_rep = n_samples / replicas
    lens = wl.batch_lengths(n_samples)
    surv = _survival(lens)
    mean_len = float(lens.mean())
    resident = min(per_rep, sp.max_batch)
    occupancy = resident * surv
    drain = float(np.sum(sp.step_s(np.maximum(occupancy, 1e-9))))
    queued = max(0.0, per_rep - sp.max_batch)
    full = queued * mean_len / sp.max_batch * sp.step_s(sp.max_batch)
    seconds = full + drain + per_rep * sp.prefill_s + sp.update_s
    mean_batch = per_rep * mean_len / max(queued * mean_len / sp.max_batch + len(surv), 1e-9)
    return seconds, mean_batch


def analyze_sync(system: System) -> SplitResult:
    """Sync RL on all devices: decode the batch to its longest sample, then train on all devices."""
    wl = system.workload
    n = wl.samples_per_batch
    reps = system.replicas(system.total_devices)
    gen_s, mean_batch = batch_generation_s(system, reps, n)
    mean_len = wl.lengths.mean()
    train_s = system.trainer.step_s(system.train_tokens(mean_len), system.total_devices)
    # Colocated: the sampler's copy is taken on the same devices (an on-device copy, not a link).
    period = gen_s + train_s
    x = n / period
    feasible = system.total_devices >= system.trainer.min_devices
    return SplitResult(
        mode="sync",
        sampler_devices=system.total_devices,
        trainer_devices=system.total_devices,
        replicas=reps,
        sample_rate=n / gen_s,
        train_rate=n / train_s,
        window_rate=x,
        samples_per_s=x,
        tokens_per_s=x * mean_len,
        train_step_s=train_s,
        period_s=period,
        decode_batch=mean_batch,
        max_staleness=0.0,
        mean_staleness=0.0,
        bottleneck="sync",
        imbalance=0.0,
        feasible=feasible,
        reason="" if feasible else "trainer does not fit in memory",
    )


def _group_survival(lengths: np.ndarray, group: int):
    """Survival of a group's longest sample (in tokens) from a batch's representative lengths."""
    srt = np.sort(lengths)

    def surv(tokens: np.ndarray) -> np.ndarray:
        cdf = np.searchsorted(srt, tokens, side="right") / len(srt)
        return 1.0 - cdf**group

    return surv


def window_period_s(system: System, replicas: int, train_s: float, step_s: float) -> float:
    """Shortest version period the staleness window allows (train_s when it does not bind).

    Admission releases a cohort of B prompts at each version; groups finish after D = their longest
    sample x step_s (+ the cohort's prefill, the weight update and `Sampler.admit_lag_s`) and are
    trained first-finished-first. A train step can start P - T after a release only if at most η
    cohorts' worth of groups are still unfinished: sum_{j>=1} S_D(j P - T) <= η, with S_D the survival
    of D. η = 0 is sync RL on the split.
    """
    wl, sp = system.workload, system.sampler
    max_staleness, n = system.max_staleness, wl.samples_per_batch
    if max_staleness == 0:
        return batch_generation_s(system, replicas, n)[0] + train_s
    lens = wl.lengths.representative(n)
    surv = _group_survival(lens, wl.draws_per_group)
    lag = n / replicas * sp.prefill_s + sp.update_s + sp.admit_lag_s
    d_max = lag + float(lens.max()) * step_s

    def unfinished(period: float) -> float:
        ages = np.arange(1, int(d_max / period) + 2) * period - train_s
        return float(np.sum(surv((ages - lag) / step_s)))

    lo, hi = max(train_s, 1e-9), train_s + d_max + 1e-9
    if unfinished(lo) <= max_staleness:
        return lo
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if unfinished(mid) <= max_staleness else (mid, hi)
    return hi


def analyze_split(system: System, sampler_devices: int, trainer_devices: int) -> SplitResult:
    """Analytic throughput and staleness of one async split (see docs/performance-model.md)."""
    sp, wl = system.sampler, system.workload
    max_staleness = system.max_staleness
    n = wl.samples_per_batch
    reps = max(system.replicas(sampler_devices), 1)
    mean_len = wl.lengths.mean()
    sync_s = system.sync_s(trainer_devices, sampler_devices)
    train_s = system.trainer.step_s(system.train_tokens(mean_len), trainer_devices) + sync_s
    train_rate = n / train_s
    slots = reps * sp.max_batch
    t_full = sp.step_s(sp.max_batch)
    sample_rate = slots / (mean_len * t_full + sp.max_batch * sp.prefill_s)
    # Fixed point: the decode batch sets the step time, which sets the window period and the rate,
    # which sets the decode batch again (Little's law: busy slots = rate x decode time per sample).
    batch = float(sp.max_batch)
    for _ in range(30):
        step_s = sp.step_s(max(batch, 1.0))
        window_rate = n / window_period_s(system, reps, train_s, step_s)
        rate = min(train_rate, sample_rate, window_rate)
        cap = sample_rate * max(0.0, 1 - sp.update_s * rate / n)  # one weight-update stall per version
        rate = min(rate, cap)
        new_batch = min(sp.max_batch, rate / reps * mean_len * step_s)
        if abs(new_batch - batch) < 1e-3 * sp.max_batch:
            break
        batch = 0.5 * (batch + new_batch)
    period = n / rate
    if rate == train_rate:
        bottleneck = "trainer"
    elif rate == window_rate:
        bottleneck = "staleness"
    else:
        bottleneck = "sampler"
    step_s = sp.step_s(max(batch, 1.0))
    longest_s = wl.lengths.expected_max(n) * step_s
    mean_stale = mean_staleness_estimate(
        bottleneck,
        max_staleness,
        busy_slots=batch * reps,
        group_ratio=wl.lengths.expected_max(wl.draws_per_group) / mean_len,
        n=n,
    )
    imbalance = 1 - min(sample_rate, train_rate) / max(sample_rate, train_rate)
    return SplitResult(
        mode="async",
        sampler_devices=sampler_devices,
        trainer_devices=trainer_devices,
        replicas=reps,
        sample_rate=sample_rate,
        train_rate=train_rate,
        window_rate=window_rate,
        samples_per_s=rate,
        tokens_per_s=rate * mean_len,
        train_step_s=train_s,
        period_s=period,
        decode_batch=batch,
        max_staleness=max(longest_s / period, mean_stale),
        mean_staleness=mean_stale,
        bottleneck=bottleneck,
        imbalance=imbalance,
        sync_s=sync_s,
    )


def mean_staleness_estimate(
    bottleneck: str, max_staleness: int, busy_slots: float, group_ratio: float, n: int
) -> float:
    """Closed-form mean head staleness (versions published between a sample's first token and training).

    When the trainer or the staleness window is the bottleneck, the admission rule is what starts
    samples: a cohort starts right after each version and, first-finished-first, is trained η versions
    later, so the mean is η. When sampler slots are the bottleneck, starts are not phase-locked and by
    Little's law mean age / period = (samples in flight + waiting) / N: busy slots, stretched by the wait
    for a group's longest sibling (group_ratio = E[max of G lengths] / E[L]), plus half a batch waiting to
    be filled.
    """
    if bottleneck != "sampler":
        return float(max_staleness)
    return float(min(max_staleness, busy_slots * group_ratio / n + 0.5))


def sweep(system: System, balance_tol: float = 0.5, staleness_metric: str = "max") -> list[SplitResult]:
    """Every split (sampler_devices, trainer_devices) with both sides non-empty, marked feasible or not.

    Args:
      system: the system to split.
      balance_tol: prune when 1 - min(rates) / max(rates) exceeds this.
      staleness_metric: "max" prunes on the longest sample's staleness, "mean" on the mean.
    """
    if staleness_metric not in ("max", "mean"):
        raise ValueError(f"staleness_metric must be 'max' or 'mean', got {staleness_metric!r}")
    out = []
    step = system.sampler.devices_per_replica
    for s in range(step, system.total_devices, step):
        t = system.total_devices - s
        r = analyze_split(system, s, t)
        fits = t >= system.trainer.min_devices
        stale = r.max_staleness if staleness_metric == "max" else r.mean_staleness
        within_max_staleness = stale <= system.max_staleness + 1e-9
        reasons = []
        if not fits:
            reasons.append(f"trainer needs >= {system.trainer.min_devices} devices")
        if not within_max_staleness:
            reasons.append(f"{staleness_metric} staleness {stale:.2f} > η={system.max_staleness}")
        if r.imbalance > balance_tol:
            reasons.append(f"rates unbalanced ({r.imbalance:.0%} > {balance_tol:.0%})")
        out.append(
            dataclasses.replace(
                r, feasible=not reasons, reason="; ".join(reasons),
                    within_max_staleness=within_max_staleness, fits=fits
            )
        )
    return out


def best_split(results: list[SplitResult], ignore_balance: bool = False) -> SplitResult | None:
    """Highest-throughput feasible split; with `ignore_balance`, only η and memory prune. None if none."""
    ok = [r for r in results if r.within_max_staleness and r.fits and (ignore_balance or r.feasible)]
    return max(ok, key=lambda r: r.tokens_per_s) if ok else None
