"""Time to target from seed-averaged curves: what `benchmarks.bench_learning` reports beside its per-seed
first crossings, because those do not survive scrutiny.

Per-seed "first evaluation at or above the target" has three faults. Evaluations every few steps quantise
each crossing by the interval (10-20% of a run's time); a seed that never reaches the target drops out,
which keeps the lucky seeds; and near a plateau one held-out evaluation's noise decides whether it
crosses at all. Here instead:

- each mode's held-out accuracy is averaged over its seeds as a curve (every run's evaluations joined by
  straight lines and held flat past its ends), on the wall-clock axis (`trained_s`: when each evaluated
  version's train step ended) and on the step axis;
- the target sits mid-curve by default: sync's averaged start plus `frac` of its way to sync's averaged end
  (where the curves are steep, so a crossing is well defined), not on sync's plateau;
- crossings are interpolated between evaluations;
- a seed that never reaches the target is not dropped: it pulls its mode's average down, and in a
  bootstrap resample whose average never crosses, that mode's time is censored (+inf), so the interval
  says so instead of forgetting it;
- the wall-time speedup splits exactly into (steps/s ratio) x (steps ratio): T_sync / T_async =
  (S_async / T_async) / (S_sync / T_sync) x (S_sync / S_async), with S the step crossing.
Intervals are percentile bootstraps over seeds, resampled in pairs (a seed's sync and async runs share its
warm start, data order and sampling keys).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

GRID = 400  # points of each averaged curve


def _curve(evals: list[dict[str, Any]], axis: str) -> tuple[np.ndarray, np.ndarray]:
    pts = sorted((float(e["trained_s"] if axis == "time" else e["step"]), float(e["accuracy"]))
                 for e in evals if axis == "step" or e.get("trained_s") is not None)  # fmt: skip
    if not pts:
        raise ValueError(f"a run has no evaluations on the {axis} axis")
    x, y = np.array(pts).T
    return x, y


def mean_curve(runs: list[list[dict[str, Any]]], axis: str, grid: np.ndarray) -> np.ndarray:
    """The seeds' accuracy averaged at each `grid` point: each run's evaluations joined by straight lines,
    held at their first and last values outside them (a finished run's policy stays as it ended)."""
    return np.mean([np.interp(grid, *_curve(evals, axis)) for evals in runs], axis=0)


def crossing(grid: np.ndarray, y: np.ndarray, target: float) -> float:
    """Where `y` first reaches `target`, linearly interpolated between grid points; +inf if it never does."""
    grid, y = np.asarray(grid, float), np.asarray(y, float)
    hit = np.nonzero(y >= target)[0]
    if not len(hit):
        return math.inf
    i = int(hit[0])
    if i == 0:
        return float(grid[0])
    x0, x1, y0, y1 = grid[i - 1], grid[i], y[i - 1], y[i]
    return float(x0 + (x1 - x0) * (target - y0) / (y1 - y0))


def _grids(evals: dict[str, list[list[dict]]]) -> dict[str, np.ndarray]:
    runs = [e for by_mode in evals.values() for e in by_mode]
    return {axis: np.linspace(0.0, max(_curve(e, axis)[0].max() for e in runs), GRID)
            for axis in ("time", "step")}  # fmt: skip


def _estimate(evals: dict[str, list[list[dict]]], grids, target: float) -> dict[str, float]:
    t = {m: crossing(grids["time"], mean_curve(r, "time", grids["time"]), target) for m, r in evals.items()}
    s = {m: crossing(grids["step"], mean_curve(r, "step", grids["step"]), target) for m, r in evals.items()}
    speedup = t["sync"] / t["async"] if math.isfinite(t["sync"]) or math.isfinite(t["async"]) else math.nan
    steps = s["sync"] / s["async"] if math.isfinite(s["sync"]) or math.isfinite(s["async"]) else math.nan
    return {"sync_s": t["sync"], "async_s": t["async"], "sync_steps": s["sync"], "async_steps": s["async"],
            "speedup": speedup, "steps_ratio": steps,
            "rate_ratio": speedup / steps if steps and math.isfinite(steps) else math.nan}  # fmt: skip


def study(sync: dict[int, dict], async_: dict[int, dict], frac: float = 0.5, boot: int = 2000,
          seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """The seed-averaged time to target of paired runs (seed -> summary.json with its `evals`).

    Returns {"seeds", "target", "frac", the point estimates (`_estimate`: each mode's crossing in seconds
    and steps, speedup = steps/s ratio x steps ratio), and per ratio its 95% bootstrap interval
    ("<name>_ci95": [lo, hi]) and the share of resamples where a mode's average never crossed
    ("censored_frac")}.
    """
    if not 0 < frac < 1:
        raise ValueError(f"frac must be in (0, 1), got {frac}")
    seeds = sorted(set(sync) & set(async_))
    if len(seeds) < 2:
        raise ValueError(f"need at least 2 paired seeds, got {seeds}")
    evals = {"sync": [sync[s]["evals"] for s in seeds], "async": [async_[s]["evals"] for s in seeds]}
    grids = _grids(evals)
    sync_curve = mean_curve(evals["sync"], "step", grids["step"])
    start, end = float(sync_curve[0]), float(sync_curve[-1])
    target = start + frac * (end - start)
    point = _estimate(evals, grids, target)
    rng = np.random.default_rng(seed)
    draws, censored = [], 0
    for _ in range(boot):
        pick = rng.integers(0, len(seeds), len(seeds))
        e = _estimate({m: [r[i] for i in pick] for m, r in evals.items()}, grids, target)
        censored += not (math.isfinite(e["sync_s"]) and math.isfinite(e["async_s"]))
        draws.append(e)
    out = {"seeds": seeds, "target": target, "frac": frac, **point, "censored_frac": censored / boot}
    for k in ("speedup", "steps_ratio", "rate_ratio"):
        vals = np.array([d[k] for d in draws], float)
        vals = vals[~np.isnan(vals)]
        out[f"{k}_ci95"] = [float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))] if len(vals) \
            else [None, None]  # fmt: skip
    return out


def line(r: dict[str, Any]) -> str:
    """One paragraph of the study for the report."""
    f = lambda v: "never" if not math.isfinite(v) else f"{v:.3g}"  # noqa: E731
    ci = lambda k: "[" + ", ".join("inf" if v is not None and not math.isfinite(v) else f(v) if v is not None
                                   else "-" for v in r[f"{k}_ci95"]) + "]"  # noqa: E731
    return (f"seed-averaged curves ({len(r['seeds'])} paired seeds), target {r['target']:.3f} "
            f"({r['frac']:.0%} of sync's way from its start to its end): sync at {f(r['sync_s'])} s "
            f"(step {f(r['sync_steps'])}), async at {f(r['async_s'])} s (step {f(r['async_steps'])}); "
            f"speedup {f(r['speedup'])} {ci('speedup')} = steps/s ratio {f(r['rate_ratio'])} "
            f"{ci('rate_ratio')} x steps ratio {f(r['steps_ratio'])} {ci('steps_ratio')} "
            f"(95% bootstrap over seeds; {r['censored_frac']:.0%} of resamples censored)")
