"""Decode step latency t(b): a roofline-shaped curve, derived from hardware or fitted to benchmark points.

Decode-bench JSON (written by benchmarks/bench_decode.py, read by `load_decode_bench`)::

    {"devices": 1,                # devices of one sampler replica the points were measured on
     "context_len": 1024,          # optional: mean context (prompt + generated) during the measurement
     "points": [{"batch": 1, "step_s": 0.0217}, {"batch": 32, "step_s": 0.143}, ...]}
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np

from jaxrl_async.perf.hardware import Hardware
from jaxrl_async.perf.shapes import ModelShape


@dataclasses.dataclass(frozen=True)
class DecodeLatency:
    """t(b) = overhead_s + max(weights_s + kv_s_per_seq * b, compute_s_per_seq * b).

    The memory-bound region (small b) streams the weights once per step plus each sequence's KV cache;
    the compute-bound region grows with the FLOPs of b tokens; overhead_s is the fixed cost of a step
    (dispatch, sampling, host work).

    Attributes:
      overhead_s: fixed seconds per decode step.
      weights_s: seconds to stream the weights once.
      kv_s_per_seq: seconds to stream one sequence's KV cache (memory-bound slope).
      compute_s_per_seq: compute seconds per sequence per step (compute-bound slope).
    """

    overhead_s: float
    weights_s: float
    kv_s_per_seq: float
    compute_s_per_seq: float

    def __post_init__(self):
        for name in ("overhead_s", "weights_s", "kv_s_per_seq", "compute_s_per_seq"):
            if getattr(self, name) < 0:
                raise ValueError(f"DecodeLatency.{name} must be >= 0, got {getattr(self, name)}")
        if self.overhead_s + max(self.weights_s + self.kv_s_per_seq, self.compute_s_per_seq) <= 0:
            raise ValueError("DecodeLatency: t(1) must be > 0")

    def step_s(self, batch):
        """Seconds per decode step at decode batch `batch` (scalar or array)."""
        b = np.asarray(batch, dtype=float)
        out = self.overhead_s + np.maximum(self.weights_s + self.kv_s_per_seq * b, self.compute_s_per_seq * b)
        return float(out) if out.ndim == 0 else out

    @property
    def knee(self) -> float:
        """Batch where compute overtakes memory (inf if it never does)."""
        slope = self.compute_s_per_seq - self.kv_s_per_seq
        return float("inf") if slope <= 0 else self.weights_s / slope

    def tokens_per_s(self, batch) -> float:
        """Decode throughput of one replica at `batch`."""
        return np.asarray(batch, dtype=float) / self.step_s(batch)


def latency_from_hardware(
    hw: Hardware,
    shape: ModelShape,
    context: float,
    devices: int = 1,
    mem_efficiency: float = 0.7,
    compute_efficiency: float = 0.5,
    overhead_s: float = 0.0,
) -> DecodeLatency:
    """Roofline t(b) of a replica of `devices` devices (ideal tensor parallel) at mean context `context`."""
    bw = hw.mem_bw * devices * mem_efficiency
    flops = hw.peak_flops * devices * compute_efficiency
    return DecodeLatency(
        overhead_s=overhead_s,
        weights_s=shape.weight_bytes / bw,
        kv_s_per_seq=shape.kv_bytes_per_token * context / bw,
        compute_s_per_seq=shape.decode_flops_per_token(context) / flops,
    )


def _hinge_design(b: np.ndarray, knee: float) -> np.ndarray:
    return np.stack([np.ones_like(b), b, np.maximum(0.0, b - knee)], axis=1)


def _to_curve(alpha: float, beta: float, gamma: float, knee: float) -> DecodeLatency | None:
    """Hinge t = alpha + beta b + gamma max(0, b - knee) as a DecodeLatency; None if not roofline-shaped."""
    overhead = alpha - gamma * knee
    tol = 1e-12 * max(1.0, abs(alpha))
    if beta < -tol or gamma < -tol or overhead < -tol or alpha + beta <= 0:
        return None
    return DecodeLatency(max(0.0, overhead), max(0.0, gamma * knee), max(0.0, beta), max(0.0, beta + gamma))


def fit_decode_latency(batch, step_s) -> DecodeLatency:
    """Least-squares roofline fit (relative error) to measured (batch, step_s) points.

    For each candidate knee the curve is linear in (alpha, beta, gamma); constrained cases (no compute
    region, no overhead, flat memory region) are solved too, and the feasible fit with the smallest
    relative squared error wins.
    """
    b = np.asarray(batch, dtype=float)
    t = np.asarray(step_s, dtype=float)
    if b.shape != t.shape or b.ndim != 1 or len(b) < 2:
        raise ValueError("fit_decode_latency needs >= 2 (batch, step_s) points")
    if np.any(b <= 0) or np.any(t <= 0):
        raise ValueError("batches and step times must be > 0")
    w = 1.0 / t  # relative error: a step time spans decades across batches
    knees = np.unique(np.concatenate([b, np.geomspace(b.min() / 4, b.max() * 4, 200)]))
    best, best_err = None, np.inf

    def consider(alpha, beta, gamma, knee):
        nonlocal best, best_err
        curve = _to_curve(alpha, beta, gamma, knee)
        if curve is None:
            return
        err = float(np.sum(((curve.step_s(b) - t) * w) ** 2))
        if err < best_err:
            best, best_err = curve, err

    for knee in knees:
        x = _hinge_design(b, knee)
        # Free columns: any subset of {alpha, beta, gamma}, plus the no-overhead tie alpha = gamma*knee.
        for cols in itertools.chain.from_iterable(itertools.combinations(range(3), k) for k in (1, 2, 3)):
            coef = np.linalg.lstsq(x[:, cols] * w[:, None], t * w, rcond=None)[0]
            full = np.zeros(3)
            full[list(cols)] = coef
            consider(*full, knee)
        tied = np.stack([b, np.maximum(knee, b)], axis=1)  # t = beta b + gamma max(knee, b)
        beta, gamma = np.linalg.lstsq(tied * w[:, None], t * w, rcond=None)[0]
        consider(gamma * knee, beta, gamma, knee)
    if best is None:
        raise ValueError("no roofline-shaped fit found for these points")
    return best


@dataclasses.dataclass(frozen=True)
class DecodeBench:
    """Measured decode points of one replica (see module docstring for the JSON format)."""

    devices: int
    batch: tuple[int, ...]
    step_s: tuple[float, ...]
    context_len: float | None = None

    def fit(self) -> DecodeLatency:
        return fit_decode_latency(self.batch, self.step_s)


def load_decode_bench(path: str) -> DecodeBench:
    """Read a decode benchmark JSON file."""
    with open(path) as f:
        d = json.load(f)
    pts = sorted(d["points"], key=lambda p: p["batch"])
    return DecodeBench(
        devices=int(d.get("devices", 1)),
        batch=tuple(int(p["batch"]) for p in pts),
        step_s=tuple(float(p["step_s"]) for p in pts),
        context_len=d.get("context_len"),
    )
