"""The split model fed with measurements of a run's own roles (the role bench of benchmarks.bench_roles with
`--decode_curve`), for runs whose roles own their hardware (separate processes on separate cores).

The sampler's decode latency t(b) is fitted to an engine of b slots at each b; `static_batch` charges
every step at the run's slot count instead (what the slotted XLA decode pays, however few slots are
busy). The trainer's speed is the role bench's trained tokens per second of one batch.
"""

from __future__ import annotations

from typing import Any

from jaxrl_async.perf.latency import fit_decode_latency
from jaxrl_async.perf.system import Sampler, System, Trainer
from jaxrl_async.perf.workload import LogNormalLengths, Workload


def calibrated_system(
    roles: dict[str, Any],
    *,
    prompts: int,
    samples: int,
    median: float,
    p99: float,
    max_len: int,
    max_staleness: int,
    static_batch: bool,
    sampler_devices: int = 1,
    trainer_devices: int = 1,
    shared_length: bool = True,
    admit_lag_s: float = 0.0,
) -> System:
    """A `System` of one sampler replica per sampler device and the measured trainer.

    Args:
      roles: a role bench with its "decode" curve (benchmarks/bench_roles.py --decode_curve).
      prompts, samples: B and G; median, p99, max_len: the lognormal completion lengths.
      shared_length: the samples of a prompt share one length (benchmarks/bench_async.py's caps).
      admit_lag_s: see `Sampler` (`engine_lag_s` gives the slotted engine's).
    """
    b, t = zip(*roles["decode"]["engine_of_b_slots"], strict=True)
    latency = fit_decode_latency(b, t)
    prompt_len = roles["tokens_per_batch"] / roles["samples_per_batch"] - roles["completion_length_mean"]
    lengths = LogNormalLengths(median, p99, max_len)
    wl = Workload(prompts, samples, round(prompt_len), lengths, shared_length=shared_length)
    sampler = Sampler(latency, 1, roles["decode"]["slots"], 0.0, roles["update_s"], static_batch, admit_lag_s)
    trainer = Trainer(roles["tokens_per_batch"] / roles["train_step_s"], 1, 0.0)
    return System(sampler_devices + trainer_devices, sampler, trainer, wl, max_staleness)


def trained_tokens_per_s(system: System, response_tokens_per_s: float) -> float:
    """The model's throughput (response tokens) as trained tokens (prompt + response), as runs report."""
    mean = system.workload.lengths.mean()
    return response_tokens_per_s * (system.workload.prompt_len + mean) / mean


def engine_lag_s(roles: dict[str, Any]) -> float:
    """The slotted engine's admission lag (`Sampler.admit_lag_s`): 2 decode calls of the run's engine.

    A group's last token lands on average half a call before the call ends; with host overlap the loop
    reads a call's finished flags only after dispatching the next call (one more call); a new version's
    cohort starts at the next call boundary (half a call on average). Each call is `steps_per_call`
    decode steps at the run's all-slots step time.
    """
    step_s = max(roles["decode"]["busy_of_run_engine"])[1]  # the most busy slots measured: all
    return 2 * roles["steps_per_call"] * step_s
