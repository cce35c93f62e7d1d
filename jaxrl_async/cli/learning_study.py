"""Time to accuracy, sync vs async: the statistics of `tools/bench_learning.py`, shared with its tests (a
module here that is no command, so importing it defines no flags).

A run is one `summary.json` (jaxrl_async.runtime.orchestrator): its held-out evaluations (step, accuracy,
and `trained_s`: when that version's train step ended, in seconds since the learner started), its steady
rates, idle fractions and staleness, and the length quantiles of its own completions. `time_to_target`
reads the first evaluation at or above the target; `compare` pairs the sync and async runs of each seed
and splits the wall-time speedup into a throughput ratio times a steps-to-target ratio.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

MODES = ("sync", "async")

# summary.json fields each run reports as they are.
RUN_KEYS = (
    "final_accuracy",
    "initial_accuracy",
    "steady_train_tokens_per_s",
    "train_tokens_per_s",
    "steady_sampler_idle_frac",
    "steady_trainer_idle_frac",
    "staleness_mean",
    "staleness_max",
    "token_staleness_mean",
    "completion_length_p50",
    "completion_length_p99",
    "train_step_s_mean",
    "wall_s",
)


def time_to_target(evals: list[dict[str, float]], target: float) -> tuple[float | None, int | None]:
    """(seconds, step) of the first evaluated version with accuracy >= `target`; (None, None) if none.

    The seconds are when that version's weights existed (`trained_s`: the end of its train step), not
    when its evaluation finished: evaluations run beside training and finish later by however long they
    take, which would charge their own latency to the run. Step 0 counts: a run that starts at the
    target needed no time."""
    for e in sorted(evals, key=lambda e: e["step"]):
        if e["accuracy"] >= target:
            if e.get("trained_s") is None:
                raise ValueError(f"evaluation of step {e['step']} has no trained_s (a resumed run?)")
            return float(e["trained_s"]), int(e["step"])
    return None, None


def run_row(summary: dict[str, Any], target: float) -> dict[str, Any]:
    """One run's figures: RUN_KEYS, the time and step to `target`, and p99/median of its completions."""
    row = {k: summary.get(k) for k in RUN_KEYS}
    row["time_to_target_s"], row["step_to_target"] = time_to_target(summary.get("evals", []), target)
    p50, p99 = row["completion_length_p50"], row["completion_length_p99"]
    row["length_p99_over_median"] = p99 / p50 if p50 and p99 is not None else None
    return row


def default_target(sync_summaries: list[dict[str, Any]], margin: float) -> float:
    """Sync's final held-out accuracy (mean of its seeds) minus `margin`."""
    finals = [s["final_accuracy"] for s in sync_summaries if s.get("final_accuracy") is not None]
    if not finals:
        raise ValueError("no sync run reported a final accuracy: no default target (pass --target)")
    return float(np.mean(finals)) - margin


def mean_of(xs) -> float | None:
    """The mean of the finite values among `xs` (None when there are none)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(xs)) if xs else None


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def compare(rows: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Means per mode and the paired async-over-sync ratios per seed.

    Args:
      rows: mode -> seed -> run_row.

    Returns:
      {"modes": mode -> mean of each figure and how many seeds reached the target,
       "paired": seed -> speedup (sync time / async time to target), throughput ratio (async / sync steady
       trained tokens/s), steps ratio (sync steps / async steps to target), final accuracy gap,
       "speedup_mean", "throughput_ratio_mean", "steps_ratio_mean", "final_gap_mean"}.
    A seed whose runs did not both reach the target has no speedup (None), and the means leave it out.
    """
    modes = {}
    for mode, by_seed in rows.items():
        keys = [*RUN_KEYS, "time_to_target_s", "step_to_target", "length_p99_over_median"]
        modes[mode] = {k: mean_of([r.get(k) for r in by_seed.values()]) for k in keys}
        modes[mode]["seeds"] = len(by_seed)
        modes[mode]["reached_target"] = sum(r["time_to_target_s"] is not None for r in by_seed.values())
    paired = {}
    for seed in sorted(set(rows.get("sync", {})) & set(rows.get("async", {}))):
        s, a = rows["sync"][seed], rows["async"][seed]
        paired[seed] = {
            "speedup": _ratio(s["time_to_target_s"], a["time_to_target_s"]),
            "throughput_ratio": _ratio(a["steady_train_tokens_per_s"], s["steady_train_tokens_per_s"]),
            "steps_ratio": _ratio(s["step_to_target"], a["step_to_target"]),
            "final_gap": None if a["final_accuracy"] is None or s["final_accuracy"] is None
            else a["final_accuracy"] - s["final_accuracy"],
        }  # fmt: skip
    out = {"modes": modes, "paired": paired}
    for k in ("speedup", "throughput_ratio", "steps_ratio", "final_gap"):
        out[f"{k}_mean"] = mean_of([p[k] for p in paired.values()])
    return out


def overlap_bound(one_core: dict[str, Any], every_core: dict[str, Any], cores: int) -> dict[str, Any]:
    """What overlap alone can buy when each of the two roles gets `cores` / 2 cores: sync's steady trained
    tokens/s on one core (`one_core`, a run_row) times `cores`, over sync's on every core (`every_core`).

    Two roles, each running at one core's speed and never waiting, make at most twice the one-core sync
    rate per two cores (the period is the larger of the two role times, at least half their sum). That
    holds while the pinned sampler does the same work per batch as sync's; what continuous batching
    saves on sync's tail (the last wave of a step, with few sequences left) comes on top of it."""
    one, every = one_core.get("steady_train_tokens_per_s"), every_core.get("steady_train_tokens_per_s")
    scaling = _ratio(every, one)
    return {"one_core_tokens_per_s": one, "every_core_tokens_per_s": every, "cores": cores,
            "core_scaling": scaling, "bound": _ratio(cores, scaling)}  # fmt: skip


def table(report: dict[str, Any]) -> str:
    """Markdown: one line per mode (means over seeds), then the paired ratios."""
    f = lambda v, p=3: "" if v is None else f"{v:.{p}g}"
    cols = ("time_to_target_s", "step_to_target", "final_accuracy", "steady_train_tokens_per_s",
            "steady_sampler_idle_frac", "steady_trainer_idle_frac", "staleness_mean", "staleness_max",
            "length_p99_over_median")  # fmt: skip
    lines = ["| mode | seeds (reached target) | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for mode, m in report["modes"].items():
        cells = [f(m[c]) for c in cols]
        lines.append(f"| {mode} | {m['seeds']} ({m['reached_target']}) | " + " | ".join(cells) + " |")
    lines += ["", "| seed | speedup (wall to target) | throughput ratio | steps ratio | final async - sync |",
              "|---|---|---|---|---|"]  # fmt: skip
    for seed, p in report["paired"].items():
        cells = [f(p["speedup"]), f(p["throughput_ratio"]), f(p["steps_ratio"]), f(p["final_gap"])]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    means = [f(report[f"{k}_mean"]) for k in ("speedup", "throughput_ratio", "steps_ratio", "final_gap")]
    lines.append("| mean | " + " | ".join(means) + " |")
    return "\n".join(lines)
