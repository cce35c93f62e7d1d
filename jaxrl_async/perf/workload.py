"""RL workload: batch shape and response-length distributions (lognormal, uniform, empirical, mixtures)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from statistics import NormalDist
from typing import Any

import numpy as np

_GRID = 20000  # quantile grid points for means and order statistics
_inv_cdf = np.vectorize(NormalDist().inv_cdf, otypes=[float])


class LengthDist:
    """A distribution of response lengths (tokens); subclasses define `quantile` and `to_dict`."""

    max_len: float | None = None

    def quantile(self, q: np.ndarray) -> np.ndarray:
        """Length at probability q (vectorised); not rounded."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (inverse of `length_dist_from_dict`)."""
        raise NotImplementedError

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n integer lengths >= 1 by inverse-transform sampling."""
        return _to_tokens(self.quantile(rng.uniform(size=n)))

    def mean(self) -> float:
        """E[L]."""
        return _mean(self)

    def top_order_stats(self, n: int, k: int) -> np.ndarray:
        """E[j-th largest of n draws] for j = 1..k: the integral of Q(u) against a Beta(n-j+1, j) density.

        Integrated on a log grid in 1-u so that the mass near u = 1 (where the maximum of a large batch
        lives) is resolved.
        """
        return np.array(_top_order_stats(self, int(n), int(k)))

    def expected_max(self, k: int) -> float:
        """E[max of k independent lengths]."""
        return float(self.top_order_stats(k, 1)[0])

    def representative(self, n: int, exact_top: int = 32) -> np.ndarray:
        """n lengths standing in for a batch of n draws, sorted ascending.

        Mid-quantiles (i - 0.5)/n for the body; the top `exact_top` are expected order statistics, since
        a mid-quantile misses how far a rare long tail reaches in a finite batch.
        """
        out = _to_tokens(self.quantile((np.arange(n) + 0.5) / n)).astype(float)
        top = self.top_order_stats(n, exact_top)
        out[n - len(top) :] = top[::-1]
        return np.maximum(1, np.round(np.sort(out))).astype(np.int64)


def _to_tokens(x: np.ndarray) -> np.ndarray:
    return np.maximum(1, np.ceil(np.asarray(x) - 1e-9)).astype(np.int64)


# The quantile grids and what is integrated on them, memoized by value: every distribution is a frozen
# dataclass (hashable by its fields), and a split sweep asks the same one for the same figures once per
# split and η, each time through thousands of inverse normal CDFs (a 16-core sweep at six η: 5 s -> 0.6 s).
@functools.lru_cache(maxsize=256)
def _mean(dist: LengthDist) -> float:
    u = (np.arange(_GRID) + 0.5) / _GRID
    return float(np.mean(_to_tokens(dist.quantile(u))))


_TOP_V = np.geomspace(1e-13, 1.0, 6000)  # 1 - u, log-spaced toward u = 1


@functools.lru_cache(maxsize=256)
def _top_grid(dist: LengthDist) -> np.ndarray:
    u = 1.0 - _TOP_V
    q = _to_tokens(dist.quantile(np.clip(u, 0.0, 1.0 - 1e-13))).astype(float)
    q.flags.writeable = False
    return q


@functools.lru_cache(maxsize=1024)
def _top_order_stats(dist: LengthDist, n: int, k: int) -> tuple[float, ...]:
    v, q = _TOP_V, _top_grid(dist)
    u = 1.0 - v
    out = []
    for j in range(min(k, n)):
        a, b = n - j, j + 1
        log_pdf = math.lgamma(n + 1) - math.lgamma(a) - math.lgamma(b)
        with np.errstate(divide="ignore"):
            log_pdf = log_pdf + (a - 1) * np.log(np.maximum(u, 1e-300)) + (b - 1) * np.log(v)
        pdf = np.exp(log_pdf)
        out.append(float(np.trapezoid(q * pdf, v) / np.trapezoid(pdf, v)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class LogNormalLengths(LengthDist):
    """Lognormal given its median and 99th percentile, clipped to [min_len, max_len] (the generation cap)."""

    median: float
    p99: float
    max_len: float | None = None
    min_len: float = 1.0

    def __post_init__(self):
        if not 0 < self.median < self.p99:
            raise ValueError(f"lognormal needs 0 < median < p99, got {self.median}, {self.p99}")
        if self.max_len is not None and self.max_len < self.min_len:
            raise ValueError("lognormal max_len < min_len")

    @property
    def sigma(self) -> float:
        return math.log(self.p99 / self.median) / NormalDist().inv_cdf(0.99)

    def quantile(self, q):
        q = np.clip(np.asarray(q, dtype=float), 1e-12, 1 - 1e-12)
        x = self.median * np.exp(self.sigma * _inv_cdf(q))
        return np.clip(x, self.min_len, self.max_len if self.max_len is not None else np.inf)

    def sample(self, rng, n):
        x = self.median * np.exp(self.sigma * rng.standard_normal(n))
        return _to_tokens(np.clip(x, self.min_len, self.max_len if self.max_len is not None else np.inf))

    def to_dict(self):
        return {
            "kind": "lognormal",
            "median": self.median,
            "p99": self.p99,
            "max_len": self.max_len,
            "min_len": self.min_len,
        }


@dataclasses.dataclass(frozen=True)
class UniformLengths(LengthDist):
    """Uniform on [low, high]."""

    low: float
    high: float

    def __post_init__(self):
        if not 0 < self.low <= self.high:
            raise ValueError(f"uniform needs 0 < low <= high, got {self.low}, {self.high}")

    @property
    def max_len(self) -> float:
        return self.high

    def quantile(self, q):
        return self.low + (self.high - self.low) * np.asarray(q, dtype=float)

    def to_dict(self):
        return {"kind": "uniform", "low": self.low, "high": self.high}


@dataclasses.dataclass(frozen=True)
class EmpiricalLengths(LengthDist):
    """Resampling of observed lengths (e.g. read back from a run's TensorBoard)."""

    values: tuple[float, ...]

    def __post_init__(self):
        if len(self.values) == 0 or min(self.values) <= 0:
            raise ValueError("empirical lengths need at least one value, all > 0")

    @property
    def max_len(self) -> float:
        return float(max(self.values))

    def quantile(self, q):
        return np.quantile(
            np.asarray(self.values, dtype=float), np.asarray(q, dtype=float), method="inverted_cdf"
        )

    def sample(self, rng, n):
        return _to_tokens(rng.choice(np.asarray(self.values, dtype=float), size=n))

    def to_dict(self):
        return {"kind": "empirical", "values": list(self.values)}


@dataclasses.dataclass(frozen=True)
class MixtureLengths(LengthDist):
    """Mixture of length distributions, e.g. a body plus a 1% long tail."""

    weights: tuple[float, ...]
    components: tuple[LengthDist, ...]

    def __post_init__(self):
        if len(self.weights) != len(self.components) or not self.components:
            raise ValueError("mixture needs one weight per component")
        if min(self.weights) <= 0:
            raise ValueError("mixture weights must be > 0")

    @property
    def probs(self) -> np.ndarray:
        w = np.asarray(self.weights, dtype=float)
        return w / w.sum()

    @property
    def max_len(self) -> float | None:
        caps = [c.max_len for c in self.components]
        return None if any(c is None for c in caps) else float(max(caps))

    def quantile(self, q):
        # Weighted quantile of the pooled component grids.
        u = (np.arange(_GRID) + 0.5) / _GRID
        xs = np.concatenate([c.quantile(u) for c in self.components])
        ws = np.concatenate([np.full(_GRID, p / _GRID) for p in self.probs])
        order = np.argsort(xs, kind="stable")
        cdf = np.cumsum(ws[order])
        idx = np.searchsorted(cdf, np.clip(np.asarray(q, dtype=float), 0, 1 - 1e-12), side="right")
        return xs[order][np.minimum(idx, len(xs) - 1)]

    def sample(self, rng, n):
        which = rng.choice(len(self.components), size=n, p=self.probs)
        out = np.empty(n, dtype=np.int64)
        for i, comp in enumerate(self.components):
            mask = which == i
            out[mask] = comp.sample(rng, int(mask.sum()))
        return out

    def to_dict(self):
        pairs = zip(self.weights, self.components, strict=True)
        return {"kind": "mixture", "components": [{"weight": w, **c.to_dict()} for w, c in pairs]}


def length_dist_from_dict(d: dict[str, Any]) -> LengthDist:
    """Build a length distribution from its JSON form (see `to_dict` of each kind)."""
    d = dict(d)
    kind = d.pop("kind", None)
    d.pop("weight", None)
    if kind == "lognormal":
        return LogNormalLengths(**d)
    if kind == "uniform":
        return UniformLengths(**d)
    if kind == "empirical":
        if "file" in d:
            with open(d["file"]) as f:
                return EmpiricalLengths(tuple(float(v) for v in json.load(f)))
        return EmpiricalLengths(tuple(float(v) for v in d["values"]))
    if kind == "tensorboard":
        return EmpiricalLengths(tuple(lengths_from_tensorboard(d["logdir"], d["tag"])))
    if kind == "mixture":
        comps = d["components"]
        return MixtureLengths(
            tuple(float(c["weight"]) for c in comps), tuple(length_dist_from_dict(c) for c in comps)
        )
    raise ValueError(
        f"unknown length distribution kind {kind!r} (lognormal, uniform, empirical, tensorboard, mixture)"
    )


def lengths_from_tensorboard(logdir: str, tag: str) -> list[float]:
    """Response lengths logged under `tag`: a histogram's buckets (expanded) or all scalar values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    if tag in tags.get("histograms", []):
        values: list[float] = []
        for event in acc.Histograms(tag):
            h = event.histogram_value
            lower = h.min
            for limit, count in zip(h.bucket_limit, h.bucket, strict=True):
                n = int(round(count))
                if n:
                    mid = 0.5 * (max(lower, h.min) + min(limit, h.max))
                    values.extend([mid] * n)
                lower = limit
        return values
    if tag in tags.get("scalars", []):
        return [e.value for e in acc.Scalars(tag)]
    raise ValueError(
        f"tag {tag!r} not found in {logdir} (histograms: {tags.get('histograms')}, "
        f"scalars: {tags.get('scalars')})"
    )


@dataclasses.dataclass(frozen=True)
class Workload:
    """One RL train batch: B prompts x G samples, prompt length P, response lengths L ~ `lengths`.

    `shared_length`: the G samples of a prompt have one length (a per-prompt generation cap with the stop
    token disabled, as benchmarks/bench_async.py imposes); by default each sample's length is its own draw.
    """

    prompts_per_batch: int
    samples_per_prompt: int
    prompt_len: int
    lengths: LengthDist
    shared_length: bool = False

    @property
    def draws_per_group(self) -> int:
        """Independent lengths in a group (its longest sample is the max of these)."""
        return 1 if self.shared_length else self.samples_per_prompt

    def batch_lengths(self, n: int) -> np.ndarray:
        """Representative lengths of n samples (sorted), groups of one length when `shared_length`."""
        if not self.shared_length:
            return self.lengths.representative(n)
        g = self.samples_per_prompt
        return np.repeat(self.lengths.representative(max(1, n // g)), g)

    def group_lengths(self, rng) -> np.ndarray:
        """One group's sample lengths."""
        if self.shared_length:
            return np.repeat(self.lengths.sample(rng, 1), self.samples_per_prompt)
        return self.lengths.sample(rng, self.samples_per_prompt)

    def __post_init__(self):
        if self.prompts_per_batch <= 0 or self.samples_per_prompt <= 0 or self.prompt_len < 0:
            raise ValueError("Workload needs prompts_per_batch > 0, samples_per_prompt > 0, prompt_len >= 0")

    @property
    def samples_per_batch(self) -> int:
        return self.prompts_per_batch * self.samples_per_prompt

    @property
    def max_context(self) -> float:
        """Longest prompt + response the KV cache must hold (cap, or p99.9 if uncapped)."""
        cap = self.lengths.max_len
        if cap is None:
            cap = float(self.lengths.quantile(np.array([0.999]))[0])
        return self.prompt_len + cap
