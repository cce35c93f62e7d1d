"""Resolving SamplerConfig.attention / .linear = "auto" to concrete kernels.

By platform (ModelConfig.platform when set, else the sampler mesh's devices): on TPU and GPU attention is
the paged cache with the Pallas kernel and the matmuls are XLA's.
On one float32 CPU device with a C++ compiler (where the CPU kernels are allowed) every combination of
{xla, cpu_kernel} for the "auto" fields is built and timed on the engine's own `generate` (all slots live,
mid-context), alternating between candidates, and the fastest median is kept. The kernels were tuned on one
CPU and measured 2x slower than XLA on another, so a fixed default cannot be right everywhere; timing on the
machine that runs is. Elsewhere "auto" is xla, and so it is for models under `MIN_TIMED_BYTES` of weights:
there a decode step is mostly per-op overhead, timing would cost more compile time than it could save, and
in the RL demo (0.4M parameters, trainer thread on the same two cores) the kernels measured slower
(8,603 vs 9,618 trained tokens/s; docs/sampler.md).

The decision is cached per process (model config, sampler config, device), so engines of the same shape
(an evaluation engine, tests) time once and agree with each other.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import time
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from jaxrl_async.sampler import cpu_kernels
from jaxrl_async.sampler.config import SamplerConfig

ACCELERATORS = ("tpu", "gpu", "cuda", "rocm")
MIN_TIMED_BYTES = 32 * 2**20  # smaller models resolve "auto" to xla without timing (module doc)

# (model config, auto-normalised sampler config, device id) -> (attention, linear, info)
_DECISIONS: dict[tuple, tuple[str, str, dict]] = {}


@dataclasses.dataclass(frozen=True)
class Choice:
    """How the "auto" fields were resolved.

    Attributes:
      attention, linear: the kernels the engine runs.
      how: "explicit" (no auto field), "platform" (decided by platform and limits), "timed" or "cached" (an
        earlier engine of the same shape in this process was timed).
      reason: why, in words (e.g. why the CPU kernels were not allowed).
      step_ms: median ms per decode step of every timed candidate, keyed "attention/linear".
    """

    attention: str
    linear: str
    how: str
    reason: str = ""
    step_ms: dict | None = None

    def describe(self) -> str:
        """The choice in words, with the timed candidates' step times."""
        how = f"{self.how}: {self.reason}" if self.reason else self.how
        if self.step_ms:
            how += "; ms a step: " + ", ".join(f"{name} {ms:.3g}" for name, ms in self.step_ms.items())
        return f"attention {self.attention}, linear {self.linear} ({how})"


def target_platform(model_cfg, mesh) -> str:
    """The platform the engine's kernels are chosen for: ModelConfig.platform when set (a program built here
    for a GPU or TPU target, on CPU devices), else the mesh's devices' ("cuda" and "rocm" are "gpu")."""
    platform = model_cfg.platform or mesh.devices.flat[0].platform
    return "gpu" if platform in ("cuda", "rocm") else platform


def cpu_kernels_unavailable(model_cfg, mesh) -> str | None:
    """Why the CPU kernels cannot run on this mesh and model (None when they can)."""
    devices = mesh.devices
    if devices.size != 1 or devices.flat[0].platform != "cpu":
        return (
            f"the sampler mesh has {devices.size} {devices.flat[0].platform} device(s); the CPU kernels need "
            "one CPU device"
        )
    if jnp.dtype(model_cfg.dtype) != jnp.float32:
        return f"the model computes in {model_cfg.dtype}; the CPU kernels need float32"
    if not cpu_kernels.compiler_available():
        return "no C++ compiler ($CXX, g++ or c++) to build the CPU kernels"
    return None


def resolve(
    model_cfg,
    mesh,
    cfg: SamplerConfig,
    make_runner: Callable[[SamplerConfig], Callable[[], None]] | None,
    rounds: int = 3,
    min_bytes: int = MIN_TIMED_BYTES,
    clock: Callable[[], float] = time.perf_counter,
) -> Choice:
    """Concrete kernels for `cfg` (see module doc).

    Args:
      make_runner: builds an engine for a concrete config and returns a function that runs one `generate`
        call and waits for it; None when there are no weights to time with (a compile-only engine): the
        CPU candidates then resolve to xla.
      rounds: timed calls per candidate (after one warm-up call that compiles).
      min_bytes: weights below this resolve to xla without timing.
      clock: seconds, read around each timed call (tests pass a clock the runners advance, so the choice
        they check does not depend on how loaded the host is).
    """
    auto = [n for n in ("attention", "linear") if getattr(cfg, n) == "auto"]
    if not auto:
        return Choice(cfg.attention, cfg.linear, "explicit")
    platform = target_platform(model_cfg, mesh)
    fixed = {n: getattr(cfg, n) for n in ("attention", "linear") if n not in auto}
    if platform in ACCELERATORS:
        out = {"attention": "paged_kernel", "linear": "xla"} | fixed
        return Choice(out["attention"], out["linear"], "platform", f"{platform}: paged cache, XLA matmuls")
    why_not = cpu_kernels_unavailable(model_cfg, mesh)
    if why_not is None and fixed.get("attention") == "paged_kernel":
        why_not = "attention='paged_kernel' runs on XLA matmuls"
    if why_not is None and make_runner is None:
        why_not = "no weights to time the kernels with (a compile-only engine)"
    weight_bytes = model_cfg.num_params * jnp.dtype(model_cfg.param_dtype).itemsize
    if why_not is None and weight_bytes < min_bytes:
        why_not = f"{weight_bytes / 2**20:.1f} MiB of weights: below {min_bytes / 2**20:.0f} MiB XLA is kept"
    if why_not is not None:
        out = {"attention": "xla", "linear": "xla"} | fixed
        return Choice(out["attention"], out["linear"], "platform", why_not)
    key = (model_cfg, dataclasses.replace(cfg, **{n: "auto" for n in auto}), mesh.devices.flat[0].id)
    if key in _DECISIONS:
        attention, linear, step_ms = _DECISIONS[key]
        return Choice(attention, linear, "cached", "timed earlier in this process", step_ms)
    options = [(fixed[n],) if n in fixed else ("xla", "cpu_kernel") for n in ("attention", "linear")]
    candidates = list(itertools.product(*options))
    step_ms = time_candidates(cfg, candidates, make_runner, rounds, clock)
    attention, linear = min(candidates, key=lambda c: step_ms[f"{c[0]}/{c[1]}"])
    _DECISIONS[key] = (attention, linear, step_ms)
    return Choice(attention, linear, "timed", "fastest decode step of the candidates", step_ms)


def time_candidates(
    cfg: SamplerConfig, candidates, make_runner, rounds: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Median ms per decode step of each (attention, linear) candidate, timed alternately."""
    runners = {}
    for attention, linear in candidates:
        run = make_runner(dataclasses.replace(cfg, attention=attention, linear=linear))
        run()  # compiles
        runners[f"{attention}/{linear}"] = run
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            t0 = clock()
            run()
            times[name].append(clock() - t0)
    # The candidate engines (weights, caches) sit in reference cycles (jitted bound methods): free them now
    # rather than at some later collection, before the chosen engine allocates its own.
    runners.clear()
    gc.collect()
    return {name: 1e3 * float(np.median(t)) / cfg.steps_per_call for name, t in times.items()}
