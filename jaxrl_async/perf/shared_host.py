"""Sync and async throughput when the sampler and the trainer share one host's cores.

The split model (`model.py`) assumes each role owns its devices. On a CPU host, fake devices share the
same cores, and on one accelerator `mesh.colocate` puts both roles on it: async RL can then only fill each
role's idle gaps with the other's work. Inputs are role benches (`benchmarks/bench_roles.py`, which measures
each role alone on the run's devices): per train batch, the sampler's wall time W_s and CPU seconds C_s,
the trainer's W_t and C_t (step + weight sync), and the sampler's weight swap U.

    sync   period = W_s(batch, drained from empty) + U + W_t
    async  period = W_long + W_short * (f - 1),   f = max(1, (C_s / W_s + C_t / W_t) / cores)

(async: W_s is the stream rate's time per batch plus U). Alone, a role keeps p = C / W cores busy on
average; while both run, processor sharing slows each by f when p_s + p_t exceeds the cores. The shorter
role's batch then takes W_short * f, during which the longer role does W_short of its own work, and the
longer role finishes the rest alone. With enough cores (f = 1) this is max(W_s, W_t), the split model's
rule; when each role alone fills the cores (f = 2 on two roles) async gains nothing. Staleness follows the
closed form of `model.py`: when the trainer is the longer role, admission runs the full η ahead (mean η),
else the sampler-bound estimate.
A split sweep over fake-device counts takes one role bench per count of each role.

`predict_lent_core` is the layout between the two: the sampler pinned to a core of its own, the learner
on every core, that one included (`jaxrl-local-cluster --cpu-sets=0,1:1`). While the sampler works, the
two share its core and each runs at its shared pace (S_s, S_t: seconds per batch and per step measured
with both running, `runtime.calibration.corun_role`); while the sampler waits, the learner has every core
(W_t(every core)). Trainer-bound, the sampler works S_s of each period and the learner gets S_s / S_t of
its step done meanwhile:

    period = S_s + W_t(every core) * (1 - S_s / S_t)        (`overlap_period`; sampler-bound alike)

Without the shared paces it takes S_s = W_s and S_t = W_t(one core), the sampler unslowed and the
learner at its one-core pace beside it: an upper bound. How much each slows the other is the scheduler's
and XLA's thread pool's doing (an operation waits for its slowest thread, and the one on the shared core
takes part of the sampler's time), so it is measured rather than modelled; on two cores it varied from
almost nothing to 1.6x between two benches an hour apart (docs/performance-model.md).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxrl_async.perf.model import mean_staleness_estimate

_FIELDS = (
    "sampler_devices",
    "trainer_devices",
    "cores",
    "num_slots",
    "samples_per_batch",
    "tokens_per_batch",
    "sample_batch_s",
    "sample_batch_cpu_s",
    "sample_stream_s",
    "sample_stream_cpu_s",
    "train_step_s",
    "train_step_cpu_s",
    "update_s",
)


@dataclasses.dataclass(frozen=True)
class RoleBench:
    """One `benchmarks/bench_roles.py` measurement (seconds per train batch; CPU seconds over all threads)."""

    sampler_devices: int
    trainer_devices: int
    cores: int
    num_slots: int
    samples_per_batch: int
    tokens_per_batch: float
    sample_batch_s: float
    sample_batch_cpu_s: float
    sample_stream_s: float
    sample_stream_cpu_s: float
    train_step_s: float
    train_step_cpu_s: float
    update_s: float = 0.0

    def __post_init__(self):
        for f in _FIELDS:
            if getattr(self, f) < 0 or (f not in ("update_s",) and getattr(self, f) == 0):
                raise ValueError(f"RoleBench.{f} must be > 0, got {getattr(self, f)}")


def load_role_bench(path: str) -> RoleBench:
    """Reads a role-bench JSON file; a missing field is named."""
    with open(path) as f:
        return role_bench(json.load(f), path)


def role_bench(d: dict[str, Any], source: str = "role bench") -> RoleBench:
    """A RoleBench from a role-bench dict (extra keys ignored); a missing field is named."""
    missing = [k for k in _FIELDS if k not in d]
    if missing:
        raise ValueError(f"{source}: role bench lacks {missing}")
    return RoleBench(**{k: d[k] for k in _FIELDS})


@dataclasses.dataclass(frozen=True)
class SharedPrediction:
    """Predicted throughput and staleness of one (sampler devices, trainer devices) pair."""

    mode: str
    sampler_devices: int
    trainer_devices: int
    period_s: float
    tokens_per_s: float
    bottleneck: str
    mean_staleness: float
    max_staleness: float
    sampler_s: float
    trainer_s: float
    slowdown: float  # f: how much each role slows while both run (1 = no contention)
    feasible: bool = True  # admission keeps every split within η, so none is pruned

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def predict_sync(sampler: RoleBench, trainer: RoleBench) -> SharedPrediction:
    """Sync RL: sample a batch to its last sample, swap weights, train; nothing overlaps."""
    period = sampler.sample_batch_s + sampler.update_s + trainer.train_step_s
    return SharedPrediction(
        mode="sync",
        sampler_devices=sampler.sampler_devices,
        trainer_devices=trainer.trainer_devices,
        period_s=period,
        tokens_per_s=trainer.tokens_per_batch / period,
        bottleneck="sync",
        mean_staleness=0.0,
        max_staleness=0.0,
        sampler_s=sampler.sample_batch_s + sampler.update_s,
        trainer_s=trainer.train_step_s,
        slowdown=1.0,
    )


def predict_async(
    sampler: RoleBench, trainer: RoleBench, max_staleness: int, cores: int | None = None
) -> SharedPrediction:
    """Async RL with staleness bound η on a host of `cores` cores shared by both roles (see module doc)."""
    if max_staleness < 1:
        raise ValueError(f"async needs max_staleness >= 1, got {max_staleness}")
    cores = cores or sampler.cores
    w_s = sampler.sample_stream_s + sampler.update_s
    w_t = trainer.train_step_s
    # Cores each keeps busy alone (capped: CPU time can include spinning beyond what the host has).
    p_s = min(sampler.sample_stream_cpu_s / w_s, cores)
    p_t = min(trainer.train_step_cpu_s / w_t, cores)
    busy = p_s + p_t
    slowdown = max(1.0, busy / cores)
    period = overlap_period(w_s, w_s * slowdown, w_t, w_t * slowdown)
    return _async(sampler, trainer, max_staleness, w_s, w_t, period, slowdown)


def overlap_period(w_s: float, shared_s: float, w_t: float, shared_t: float) -> float:
    """The async period of two roles that slow each other while both run: W alone, `shared` beside the other.

    The role with the shorter shared time runs beside the other for all of it (shared_short), while the
    other gets shared_short / shared_long of its own work done; the rest it does alone, at its alone
    pace: period = shared_short + W_long * (1 - shared_short / shared_long). With no slowing this is
    max(W_s, W_t); with both slowed by f it is W_long + W_short * (f - 1).
    """
    (short, _), (long_shared, long_alone) = sorted(((shared_s, w_s), (shared_t, w_t)))
    return short + long_alone * (1.0 - short / long_shared)


def _async(sampler: RoleBench, trainer: RoleBench, max_staleness: int, w_s: float, w_t: float, period: float,
           slowdown: float) -> SharedPrediction:  # fmt: skip
    """The async prediction of a period: the pace (the longer role) sets the staleness."""
    sampler_paced = w_s > w_t
    pace = "sampler" if sampler_paced else "trainer"
    n = sampler.samples_per_batch
    mean = mean_staleness_estimate(pace, max_staleness, busy_slots=min(sampler.num_slots, n),
                                   group_ratio=1.0, n=n)
    return SharedPrediction(
        mode="async",
        sampler_devices=sampler.sampler_devices,
        trainer_devices=trainer.trainer_devices,
        period_s=period,
        tokens_per_s=trainer.tokens_per_batch / period,
        bottleneck=pace,
        mean_staleness=mean,
        max_staleness=float(max_staleness) if not sampler_paced else mean,
        sampler_s=w_s,
        trainer_s=w_t,
        slowdown=slowdown,
    )


def predict_lent_core(sampler_one: RoleBench, trainer_one: RoleBench, trainer_every: RoleBench,
                      max_staleness: int,
                      shared: tuple[float, float] | None = None) -> SharedPrediction:  # fmt: skip
    """Async RL with the sampler pinned to one core and the learner on every core (see module doc):
    `sampler_one` and `trainer_one` are benches on one core, `trainer_every` on all of them.

    `shared`: (the sampler's stream seconds per batch, the learner's seconds per step) measured while both
    run in this layout (`runtime.calibration.corun_role`). Without it the sampler is taken as unslowed
    and the learner as keeping its one-core pace beside it: an upper bound. `slowdown` is the sampler's.
    """
    if max_staleness < 1:
        raise ValueError(f"async needs max_staleness >= 1, got {max_staleness}")
    w_s = sampler_one.sample_stream_s + sampler_one.update_s
    w_t = min(trainer_every.train_step_s, trainer_one.train_step_s)  # a learner never leaves its own core
    if shared is None:
        shared_s, shared_t = w_s, trainer_one.train_step_s
    elif min(shared) <= 0:
        raise ValueError(f"predict_lent_core: shared seconds must be > 0, got {shared}")
    else:  # never faster than alone (a noisy bench can say so)
        shared_s, shared_t = max(shared[0] + sampler_one.update_s, w_s), max(shared[1], w_t)
    period = overlap_period(w_s, shared_s, w_t, shared_t)
    # The pacing role takes the whole period; the other its shared time (it runs beside it throughout).
    sampler_s, trainer_s = (shared_s, period) if shared_t >= shared_s else (period, shared_t)
    return _async(sampler_one, trainer_every, max_staleness, sampler_s, trainer_s, period, shared_s / w_s)


def sweep_shared(benches: list[RoleBench], total_devices: int, max_staleness: int) -> list[SharedPrediction]:
    """Async predictions for every split s + t = total whose sampler count s and trainer count t were benched.

    The sampler figures of a split come from a bench with `sampler_devices == s`, the trainer figures from
    one with `trainer_devices == t` (one bench at (k, k) serves both roles at k devices).
    """
    by_s = {b.sampler_devices: b for b in benches}
    by_t = {b.trainer_devices: b for b in benches}
    out = [
        predict_async(by_s[s], by_t[total_devices - s], max_staleness)
        for s in sorted(by_s)
        if 0 < s < total_devices and total_devices - s in by_t
    ]
    if not out:
        raise ValueError(
            f"no benched split sums to {total_devices} devices "
            f"(sampler counts {sorted(by_s)}, trainer counts {sorted(by_t)})"
        )
    return out


def overlap_ceiling(every: RoleBench, one: RoleBench) -> dict[str, float]:
    """The most two pinned processes (sampler on one core, trainer on another) can gain over sync on the
    same cores, from role benches on every core (`every`: what sync gets) and on one core (`one`).

    Sync samples a batch to its last token on every core, syncs and trains: period
    S_2 + U_2 + T_2. The pinned roles overlap: period max(A_1, T_1 + U_1), where A_1 is the sampler's
    streaming time per batch on one core (continuous batching: no drained tail) and T_1 the train step on
    one core. So the ceiling is (S_2 + U_2 + T_2) / max(A_1, T_1 + U_1). Its parts, printed with it:
      tau: S_1 / A_1, a drained batch's sampling time over the streaming time per batch on the same core
        (> 1: streaming saves the tail on top of the overlap);
      f: S_2 / (S_2 + U_2 + T_2), the sampling share of sync's step;
      the roles' one- and every-core speeds (batches per second), whose ratio is what the second core
        buys each role when it has both.
    Returns {"tau", "f", "sync_period_s", "async_period_s", "ceiling", "sampler_batches_per_s_1core",
    "sampler_batches_per_s_every", "trainer_steps_per_s_1core", "trainer_steps_per_s_every"}.
    """
    sync_s = every.sample_batch_s + every.update_s + every.train_step_s
    async_s = max(one.sample_stream_s, one.train_step_s + one.update_s)
    return {
        "tau": one.sample_batch_s / one.sample_stream_s,
        "f": every.sample_batch_s / sync_s,
        "sync_period_s": sync_s,
        "async_period_s": async_s,
        "ceiling": sync_s / async_s,
        "sampler_batches_per_s_1core": 1.0 / one.sample_batch_s,
        "sampler_batches_per_s_every": 1.0 / every.sample_batch_s,
        "trainer_steps_per_s_1core": 1.0 / one.train_step_s,
        "trainer_steps_per_s_every": 1.0 / every.train_step_s,
    }
