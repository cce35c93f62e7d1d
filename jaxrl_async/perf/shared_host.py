"""Sync and async throughput when the sampler and the trainer share one host's cores.

The split model (`model.py`) assumes each role owns its devices. On a CPU host, fake devices share the
same cores, and on one accelerator `mesh.colocate` puts both roles on it: async RL can then only fill each
role's idle gaps with the other's work. Inputs are role benches (`tools/bench_roles.py`, which measures
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
on every core, that one included (`jaxrl-local-cluster --cpu-sets=0,1:1`). The learner then runs at its
one-core speed v1 = 1/W_t(one core) plus the share of the sampler's core the sampler leaves idle, times
what that core adds (v2 - v1, v2 = 1/W_t(every core)). Trainer-bound, the sampler keeps its core busy a
share W_s * v of the time, so v = v1 + (1 - W_s * v)(v2 - v1), that is v = v2 / (1 + W_s (v2 - v1)), and
the period is max(1/v, W_s). It takes the sampler's speed as unchanged by the learner's thread beside it:
an upper bound.
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
    """One `tools/bench_roles.py` measurement (seconds per train batch; CPU seconds over all threads)."""

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
    sampler: RoleBench, trainer: RoleBench, eta: int, cores: int | None = None
) -> SharedPrediction:
    """Async RL with staleness bound η on a host of `cores` cores shared by both roles (see module doc)."""
    if eta < 1:
        raise ValueError(f"async needs eta >= 1, got {eta}")
    cores = cores or sampler.cores
    w_s = sampler.sample_stream_s + sampler.update_s
    w_t = trainer.train_step_s
    # Cores each keeps busy alone (capped: CPU time can include spinning beyond what the host has).
    p_s = min(sampler.sample_stream_cpu_s / w_s, cores)
    p_t = min(trainer.train_step_cpu_s / w_t, cores)
    busy = p_s + p_t
    slowdown = max(1.0, busy / cores)
    period = max(w_s, w_t) + min(w_s, w_t) * (slowdown - 1)
    return _async(sampler, trainer, eta, w_s, w_t, period, slowdown)


def _async(sampler: RoleBench, trainer: RoleBench, eta: int, w_s: float, w_t: float, period: float,
           slowdown: float) -> SharedPrediction:  # fmt: skip
    """The async prediction of a period: the pace (the longer role) sets the staleness."""
    sampler_paced = w_s > w_t
    pace = "sampler" if sampler_paced else "trainer"
    n = sampler.samples_per_batch
    mean = mean_staleness_estimate(pace, eta, busy_slots=min(sampler.num_slots, n), group_ratio=1.0, n=n)
    return SharedPrediction(
        mode="async",
        sampler_devices=sampler.sampler_devices,
        trainer_devices=trainer.trainer_devices,
        period_s=period,
        tokens_per_s=trainer.tokens_per_batch / period,
        bottleneck=pace,
        mean_staleness=mean,
        max_staleness=float(eta) if not sampler_paced else mean,
        sampler_s=w_s,
        trainer_s=w_t,
        slowdown=slowdown,
    )


def predict_lent_core(sampler_one: RoleBench, trainer_one: RoleBench, trainer_every: RoleBench,
                      eta: int) -> SharedPrediction:  # fmt: skip
    """Async RL with the sampler pinned to one core and the learner on every core (see module doc):
    `sampler_one` and `trainer_one` are benches on one core, `trainer_every` on all of them."""
    if eta < 1:
        raise ValueError(f"async needs eta >= 1, got {eta}")
    w_s = sampler_one.sample_stream_s + sampler_one.update_s
    v1, v2 = 1.0 / trainer_one.train_step_s, 1.0 / trainer_every.train_step_s  # RoleBench: both > 0
    v2 = max(v2, v1)  # a learner slower on every core than on one never leaves its own
    w_t = (1.0 + w_s * (v2 - v1)) / v2
    # slowdown 1: the sampler is taken as unslowed by the learner's thread beside it (an upper bound)
    return _async(sampler_one, trainer_every, eta, w_s, w_t, max(w_s, w_t), 1.0)


def sweep_shared(benches: list[RoleBench], total_devices: int, eta: int) -> list[SharedPrediction]:
    """Async predictions for every split s + t = total whose sampler count s and trainer count t were benched.

    The sampler figures of a split come from a bench with `sampler_devices == s`, the trainer figures from
    one with `trainer_devices == t` (one bench at (k, k) serves both roles at k devices).
    """
    by_s = {b.sampler_devices: b for b in benches}
    by_t = {b.trainer_devices: b for b in benches}
    out = [
        predict_async(by_s[s], by_t[total_devices - s], eta)
        for s in sorted(by_s)
        if 0 < s < total_devices and total_devices - s in by_t
    ]
    if not out:
        raise ValueError(
            f"no benched split sums to {total_devices} devices "
            f"(sampler counts {sorted(by_s)}, trainer counts {sorted(by_t)})"
        )
    return out
