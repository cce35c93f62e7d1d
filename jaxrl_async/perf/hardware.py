"""Accelerator specs for rooflines: presets from vendor spec sheets, and a quick measurement of this CPU."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device's roofline numbers.

    Attributes:
      name: label used in reports.
      peak_flops: dense bf16/fp16 matmul FLOP/s (f32 for a CPU).
      mem_bw: memory bandwidth, bytes/s.
      mem_bytes: device memory, bytes.
    """

    name: str
    peak_flops: float
    mem_bw: float
    mem_bytes: float

    def __post_init__(self):
        for name in ("peak_flops", "mem_bw", "mem_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Hardware.{name} must be > 0, got {getattr(self, name)}")


# Dense (no sparsity) bf16 peaks and HBM figures from the vendors' public spec sheets (cited in
# docs/performance-model.md). H800 SXM has the H100 SXM compute and memory; only NVLink is cut.
PRESETS: dict[str, Hardware] = {
    "tpu-v5e": Hardware("tpu-v5e", 197e12, 819e9, 16e9),
    "tpu-v5p": Hardware("tpu-v5p", 459e12, 2765e9, 95e9),
    "tpu-v6e": Hardware("tpu-v6e", 918e12, 1640e9, 32e9),
    "h100": Hardware("h100", 989e12, 3.35e12, 80e9),
    "h800": Hardware("h800", 989e12, 3.35e12, 80e9),
    "h200": Hardware("h200", 989e12, 4.8e12, 141e9),
}


def _median_time(fn, seconds: float, min_reps: int = 3) -> float:
    """Median wall time of fn() over repetitions filling about `seconds`."""
    times = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_matmul_flops(n: int = 1024, seconds: float = 1.0) -> float:
    """f32 matmul FLOP/s of this host with numpy (BLAS, all cores)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm-up: BLAS thread start-up
    return 2.0 * n**3 / _median_time(lambda: a @ b, seconds)


def measure_memory_bandwidth(nbytes: int = 256 << 20, seconds: float = 1.0) -> float:
    """Read bandwidth (bytes/s): a reduction over an array much larger than the caches."""
    x = np.ones(nbytes // 4, dtype=np.float32)
    x.sum()
    return nbytes / _median_time(x.sum, seconds)


def host_memory_bytes() -> float:
    """Physical memory of this host."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measure_this_cpu(seconds: float = 2.0) -> Hardware:
    """Measure this CPU as one device (a few seconds): f32 matmul peak and read bandwidth."""
    flops = measure_matmul_flops(seconds=seconds / 2)
    bw = measure_memory_bandwidth(seconds=seconds / 2)
    return Hardware("this-cpu", flops, bw, host_memory_bytes())


def get_hardware(name: str, seconds: float = 2.0) -> Hardware:
    """A preset by name, or "cpu" to measure this host."""
    key = name.lower()
    if key in ("cpu", "this-cpu"):
        return measure_this_cpu(seconds)
    if key not in PRESETS:
        raise ValueError(f"unknown hardware {name!r}; presets: {sorted(PRESETS)} or 'cpu'")
    return PRESETS[key]


def hardware_from_dict(d: dict | str) -> Hardware:
    """Hardware from a scenario: a preset name, {"preset": name, ...overrides} or all four fields."""
    if isinstance(d, str):
        return get_hardware(d)
    d = dict(d)
    if "preset" in d:
        base = dataclasses.asdict(get_hardware(d.pop("preset")))
        base.update(d)
        d = base
    return Hardware(**d)
