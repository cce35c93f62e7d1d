"""Time to accuracy, sync vs async: the statistics and the split model's predictions of
`benchmarks/bench_learning.py`, shared with its tests (a module here that is no command, so importing it
defines no flags).

A run is one `summary.json` (jaxrl_async.runtime.orchestrator): its held-out evaluations (step, accuracy,
and `trained_s`: when that version's train step ended, in seconds since the learner started), its steady
rates, idle fractions and staleness, and the length quantiles of its own completions. `time_to_target`
reads the first evaluation at or above the target; `compare` pairs the sync and async runs of each seed
and splits the wall-time speedup into a throughput ratio times a steps-to-target ratio.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from benchmarks.eta_study import mean_ci

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
    "first_step_s",
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
    row["late_accuracy"] = late_accuracy(summary.get("evals", []))
    # The same clock from the end of the first step: what a long run's start-up (compiling, the first
    # evaluation and batch) no longer weighs in.
    t, first = row["time_to_target_s"], row["first_step_s"]
    row["time_after_first_step_s"] = t - first if t is not None and first is not None else None
    cache = summary.get("compile_cache") or {}  # the learner's process: its compiles, those the cache gave
    row["compiles"], row["compiles_loaded"] = cache.get("compiles"), cache.get("loaded")
    # Sampler processes other than 0 (async): the programs their own store loaded and compiled.
    own = list((summary.get("sampler_executables") or {}).values())
    row["sampler_programs_loaded"] = sum(x["loaded"] for x in own) if own else None
    row["sampler_programs_compiled"] = sum(x["compiled"] for x in own) if own else None
    p50, p99 = row["completion_length_p50"], row["completion_length_p99"]
    row["length_p99_over_median"] = p99 / p50 if p50 and p99 is not None else None
    return row


# Evaluations a run's late accuracy averages. One greedy evaluation of a policy that is still learning moves
# by 3-5 points from one evaluation to the next (letter_range, 10 steps apart), a move of the policy and
# not of the sampling (the held-out split is evaluated whole): the last one alone decides a one-point
# question by that swing.
LATE_EVALS = 3


def late_accuracy(evals: list[dict[str, float]]) -> float | None:
    """The mean held-out accuracy of the last LATE_EVALS evaluated versions (None: no evaluation)."""
    late = sorted(evals, key=lambda e: e["step"])[-LATE_EVALS:]
    return float(np.mean([e["accuracy"] for e in late])) if late else None


def default_target(sync_summaries: list[dict[str, Any]], margin: float) -> float:
    """Sync's final held-out accuracy (mean of its seeds) minus `margin`."""
    finals = [s["final_accuracy"] for s in sync_summaries if s.get("final_accuracy") is not None]
    if not finals:
        raise ValueError("no sync run reported a final accuracy: no default target (pass --target)")
    return float(np.mean(finals)) - margin


def seed_targets(sync_summaries: dict[int, dict[str, Any]], margin: float) -> dict[int, float]:
    """Each seed's own target: its sync run's final held-out accuracy minus `margin`.

    A common target (`default_target`) counts only the seeds whose sync run ends above it, and the seeds'
    finals spread further than a point (letter_range: 0.39-0.50), so a 3-seed study rests on two pairs.
    Against its own seed's sync final every pair counts: sync reaches it (its last evaluation is at or
    above it), and the question is when, and whether, async does (same warm start, data order and
    sampling keys)."""
    return {s: float(v["final_accuracy"]) - margin for s, v in sync_summaries.items()
            if v.get("final_accuracy") is not None}  # fmt: skip


def mean_of(xs) -> float | None:
    """The mean of the finite values among `xs` (None when there are none)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(xs)) if xs else None


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


# The paired figures of a seed (async over sync), each with its mean and 95% t interval over seeds.
PAIRED = ("speedup", "speedup_after_first_step", "throughput_ratio", "steps_ratio", "final_gap", "late_gap")


def compare(rows: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Means per mode and the paired async-over-sync ratios per seed.

    Args:
      rows: mode -> seed -> run_row.

    Returns:
      {"modes": mode -> mean of each figure and how many seeds reached the target,
       "paired": seed -> speedup (sync time / async time to target), the same after each run's first step,
       throughput ratio (async / sync steady trained tokens/s), steps ratio (sync steps / async steps to
       target), final accuracy gap, the same of the late accuracies (`late_accuracy`), and the mean of each
       as "<name>_mean"}.
    A seed whose runs did not both reach the target has no speedup (None), and the means leave it out.
    """
    modes = {}
    for mode, by_seed in rows.items():
        keys = [*RUN_KEYS, "time_to_target_s", "time_after_first_step_s", "step_to_target",
                "length_p99_over_median", "late_accuracy"]  # fmt: skip
        modes[mode] = {k: mean_of([r.get(k) for r in by_seed.values()]) for k in keys}
        modes[mode]["seeds"] = len(by_seed)
        modes[mode]["reached_target"] = sum(r["time_to_target_s"] is not None for r in by_seed.values())
    paired = {}
    for seed in sorted(set(rows.get("sync", {})) & set(rows.get("async", {}))):
        s, a = rows["sync"][seed], rows["async"][seed]
        paired[seed] = {
            "speedup": _ratio(s["time_to_target_s"], a["time_to_target_s"]),
            "speedup_after_first_step": _ratio(s["time_after_first_step_s"], a["time_after_first_step_s"]),
            "throughput_ratio": _ratio(a["steady_train_tokens_per_s"], s["steady_train_tokens_per_s"]),
            "steps_ratio": _ratio(s["step_to_target"], a["step_to_target"]),
            "final_gap": None if a["final_accuracy"] is None or s["final_accuracy"] is None
            else a["final_accuracy"] - s["final_accuracy"],
            "late_gap": None if a.get("late_accuracy") is None or s.get("late_accuracy") is None
            else a["late_accuracy"] - s["late_accuracy"],
        }  # fmt: skip
    out = {"modes": modes, "paired": paired}
    for k in PAIRED:
        out[f"{k}_mean"] = mean_of([p[k] for p in paired.values()])
        out[f"{k}_ci95"] = mean_ci([p[k] for p in paired.values()])
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
    f = _fmt
    cols = ("time_to_target_s", "first_step_s", "step_to_target", "final_accuracy", "late_accuracy",
            "steady_train_tokens_per_s", "steady_sampler_idle_frac", "steady_trainer_idle_frac",
            "staleness_mean", "staleness_max", "length_p99_over_median")  # fmt: skip
    lines = ["| mode | seeds (reached target) | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for mode, m in report["modes"].items():
        cells = [f(m[c]) for c in cols]
        lines.append(f"| {mode} | {m['seeds']} ({m['reached_target']}) | " + " | ".join(cells) + " |")
    lines += ["", *_paired_table(report)]
    return "\n".join(lines)


def _fmt(v, p=3) -> str:
    """A table cell: `v` to `p` significant digits, empty for None."""
    return "" if v is None else f"{v:.{p}g}"


def _paired_table(report: dict[str, Any], targets: dict[int, float] | None = None) -> list[str]:
    """The paired ratios per seed, their means and 95% t intervals (with `targets`: each seed's own)."""
    f = _fmt
    head = "| seed | " + ("own target | " if targets else "")
    lines = [head + "speedup (wall to target) | after the first step | throughput ratio | steps ratio "
             f"| final async - sync | late async - sync (mean of the last {LATE_EVALS} evaluations) |",
             "|---|" + "---|" * (len(PAIRED) + bool(targets))]  # fmt: skip
    for seed, p in report["paired"].items():
        own = f"{f(targets.get(seed))} | " if targets else ""
        lines.append(f"| {seed} | {own}" + " | ".join(f(p.get(k)) for k in PAIRED) + " |")
    pad = " | " if targets else ""
    lines.append("| mean | " + pad + " | ".join(f(report.get(f"{k}_mean")) for k in PAIRED) + " |")

    def interval(c):
        return "" if not c or c["lo"] is None else f"{f(c['lo'])} to {f(c['hi'])} (n = {c['n']})"

    lines.append("| 95% t interval | " + pad + " | ".join(interval(report.get(f"{k}_ci95")) for k in PAIRED)
                 + " |")  # fmt: skip
    return lines


def own_target_table(report: dict[str, Any], targets: dict[int, float]) -> str:
    """Markdown: the paired ratios against each seed's own target (`seed_targets`), how many reached it."""
    m = report["modes"]
    head = (f"each seed's own target (its sync final minus the margin): sync reached it in "
            f"{m['sync']['reached_target']} of {m['sync']['seeds']}, async in {m['async']['reached_target']} "
            f"of {m['async']['seeds']}")  # fmt: skip
    return "\n".join([head, "", *_paired_table(report, targets)])


PREDICT_HOST_CORES = 16  # the host the split model is also asked about (the 16-core node)
NEAR_BEST = 0.95  # a split within 5% of the best is as good as it within the role benches' run-to-run noise


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the split model needs of the runs besides the role benches and the lengths."""

    max_staleness: int  # the async runs' staleness bound
    processes: int  # async roles in 1 process (sharing every core) or 2 (pinned to a core each)
    prompts: int  # prompts_per_step
    samples: int  # samples_per_prompt
    # 2 processes: the learner on every core, the sampler pinned to one of them (--async-cpu-sets=0,1:1)
    lent_core: bool = False


def shared_paces(corun: dict[str, dict] | None, every: dict) -> tuple[float, float] | None:
    """(the sampler's seconds per batch, the learner's per step) while both ran in the lent layout, from the
    co-run benches ({"sampler": ..., "trainer": ...}: `runtime.calibration.corun_role`); the learner's step
    is its micro-batch time over the mean micro-batches of a batch (`every`'s role bench). None: no co-run."""
    if not corun:
        return None
    step = corun["trainer"]["train_micro_batch_s"] * every["train_micro_batches"]
    return corun["sampler"]["sample_stream_s"], step


def predict(benches: dict[str, dict], setup: Setup, lengths: dict[str, float]) -> dict:
    """The split model's throughput of both modes from the role benches ({"every": on every core, "one": on
    one core with its decode curve, and with the lent core "corun": each role's co-run bench};
    `benchmarks/bench_learning.py` times them) and the completion lengths."""
    from jaxrl_async.perf import model as pm
    from jaxrl_async.perf.calibrated import calibrated_system, engine_lag_s, trained_tokens_per_s
    from jaxrl_async.perf.shared_host import predict_async, predict_lent_core, predict_sync, role_bench

    every = role_bench(benches["every"])
    sync = predict_sync(every, every).to_dict()
    if setup.processes == 1:
        async_ = predict_async(every, every, setup.max_staleness,
                               cores=len(os.sched_getaffinity(0))).to_dict()
        best16 = any16 = by_max_staleness16 = None
    else:
        one = benches["one"]

        def system(s: int, t: int, max_staleness: int = setup.max_staleness):
            return calibrated_system(
                one, prompts=setup.prompts, samples=setup.samples, median=lengths["median"],
                p99=lengths["p99"], max_len=lengths["max"], max_staleness=max_staleness, static_batch=True,
                admit_lag_s=engine_lag_s(one), sampler_devices=s, trainer_devices=t,
            )  # fmt: skip

        if setup.lent_core:
            shared = shared_paces(benches.get("corun"), benches["every"])
            async_ = predict_lent_core(role_bench(one), role_bench(one), every, setup.max_staleness,
                                       shared).to_dict()
            if shared:  # beside it, the form without the co-run (its upper bound)
                bound = predict_lent_core(role_bench(one), role_bench(one), every, setup.max_staleness)
                async_["shared_paces_s"] = list(shared)
                async_["tokens_per_s_without_corun"] = bound.tokens_per_s
        else:
            r = pm.analyze_split(system(1, 1), 1, 1)
            async_ = {**r.to_dict(), "tokens_per_s": trained_tokens_per_s(system(1, 1), r.tokens_per_s)}
        half = PREDICT_HOST_CORES // 2
        best16, any16 = best_splits_of_host(system(half, half), setup.max_staleness)
        top = max(setup.max_staleness, any16["max_staleness_needed"] if any16 else 0) + 1
        by_max_staleness16 = best_split_at_each_max_staleness(lambda max_staleness: system(half, half,
                                                                                           max_staleness),
                                                                                               top)
    ratio = async_["tokens_per_s"] / sync["tokens_per_s"]
    return {"sync": sync, "async": async_, "ratio": ratio, "best_split_16_cores": best16,
            "best_split_16_cores_any_max_staleness": any16,
                "best_split_16_cores_by_max_staleness": by_max_staleness16,
            "lengths": lengths}  # fmt: skip


def best_splits_of_host(big, max_staleness: int) -> tuple[dict | None, dict | None]:
    """The split model's best split of `big`'s devices within η (balance not required), and its best at any
    η with the η that one needs: on a host with many trainer cores the trainer can step faster than the
    longest completion decodes, and holding η then costs throughput."""
    from jaxrl_async.perf import model as pm
    from jaxrl_async.perf.calibrated import trained_tokens_per_s

    results = pm.sweep(big)

    def row(r):
        if r is None:
            return None
        tokens = trained_tokens_per_s(big, r.tokens_per_s)
        return {**r.to_dict(), "cores": big.total_devices, "tokens_per_s": tokens}

    anyway = row(max((r for r in results if r.fits), key=lambda r: r.tokens_per_s, default=None))
    if anyway is not None:
        anyway["max_staleness_needed"] = max(max_staleness, math.ceil(anyway["max_staleness"] - 1e-9))
    return row(pm.best_split(results, ignore_balance=True)), anyway


def best_split_at_each_max_staleness(system_at, top: int) -> list[dict]:
    """The split model's best split within each η from 1 to `top` (system_at(η): the host's system at that
    bound), with its trained tokens/s and the splits within NEAR_BEST of it: what each η buys on the host,
    and how flat the optimum is (a flat one moves between role benches that differ by noise)."""
    from jaxrl_async.perf import model as pm
    from jaxrl_async.perf.calibrated import trained_tokens_per_s

    rows = []
    for max_staleness in range(1, top + 1):
        big = system_at(max_staleness)
        held = [r for r in pm.sweep(big) if r.within_max_staleness and r.fits]
        if not held:
            rows.append({"max_staleness": max_staleness, "sampler_devices": None})
            continue
        tokens = {r.sampler_devices: trained_tokens_per_s(big, r.tokens_per_s) for r in held}
        best = max(held, key=lambda r: r.tokens_per_s)
        near = sorted(s for s, x in tokens.items() if x >= NEAR_BEST * tokens[best.sampler_devices])
        rows.append({"max_staleness": max_staleness, "sampler_devices": best.sampler_devices,
                     "trainer_devices": best.trainer_devices, "tokens_per_s": tokens[best.sampler_devices],
                     "imbalance": best.imbalance, "near_best_sampler_devices": near})  # fmt: skip
    return rows


def predict_realized(benches: dict[str, dict], setup: Setup, lengths: dict[str, float],
                     rows: dict[str, dict[int, dict]]) -> dict | None:  # fmt: skip
    """The same model with what the runs realized in place of what the warm start showed: each mode's
    own mean train step (the trainer's work shrinks as the policy learns: groups that are all right or all
    wrong are skipped) and the async runs' own completion lengths. Beside the prediction it tells the
    model's error from the workload's drift. None when a run lacks the figures."""
    mean = lambda mode, key: mean_of([r.get(key) for r in rows[mode].values()])  # noqa: E731
    sync_step, async_step = mean("sync", "train_step_s_mean"), mean("async", "train_step_s_mean")
    p50, p99 = mean("async", "completion_length_p50"), mean("async", "completion_length_p99")
    if None in (sync_step, async_step, p50, p99):
        return None
    realized_lengths = {**lengths, "median": p50, "p99": p99}
    realized = {"every": {**benches["every"], "train_step_s": sync_step},
                "one": {**benches["one"], "train_step_s": async_step}}  # fmt: skip
    out = predict(realized, setup, realized_lengths)
    if setup.processes == 1 or setup.lent_core:
        # The async learner ran on every core (beside the sampler, or with its idle share of the sampler's
        # core): its prediction takes the async runs' own step there.
        every_async = {**realized, "every": {**benches["every"], "train_step_s": async_step}}
        out["async"] = predict(every_async, setup, realized_lengths)["async"]
        out["ratio"] = out["async"]["tokens_per_s"] / out["sync"]["tokens_per_s"]
    out["train_step_s"] = {"sync": sync_step, "async": async_step,
                           "role_bench_every_core": benches["every"]["train_step_s"],
                           "role_bench_one_core": benches["one"]["train_step_s"]}  # fmt: skip
    return out


def host_split_line(prediction: dict, max_staleness: int) -> str | None:
    """One line on the split model's best split of the PREDICT_HOST_CORES-core host (None: no such figure)."""
    within = prediction.get("best_split_16_cores")
    anyway = prediction.get("best_split_16_cores_any_max_staleness")
    if anyway is None:
        return None

    def split(r):
        flag = "" if r["feasible"] else f" [{r['reason']}]"
        return (f"{r['sampler_devices']} sampler + {r['trainer_devices']} trainer cores, "
                f"{r['tokens_per_s']:,.0f} trained tokens/s{flag}")  # fmt: skip

    head = f"split model, a {anyway['cores']}-core host: "
    bound = max_staleness
    best = f"best within η = {bound}: {split(within)}" if within else f"no split holds η = {bound}"
    if within and within["sampler_devices"] == anyway["sampler_devices"]:
        return head + best
    return head + f"{best}; best at any η: {split(anyway)}, needs η ≥ {anyway['max_staleness_needed']}"


def host_max_staleness_line(prediction: dict) -> str | None:
    """One line on what each η buys on the PREDICT_HOST_CORES-core host (None: no such figure)."""
    rows = prediction.get("best_split_16_cores_by_max_staleness")
    if not rows:
        return None

    def at(r):
        if r["sampler_devices"] is None:
            return f"η {r['max_staleness']}: no split holds it"
        near = r["near_best_sampler_devices"]
        band = f" (within 5% of it: {', '.join(map(str, near))} sampler cores)" if len(near) > 1 else ""
        return (f"η {r['max_staleness']}: {r['sampler_devices']} + {r['trainer_devices']}, "
                f"{r['tokens_per_s']:,.0f}{band}")  # fmt: skip

    return (
        f"split model, a {PREDICT_HOST_CORES}-core host, best split (sampler + trainer cores, trained "
        f"tokens/s) at each η: " + "; ".join(at(r) for r in rows)
    )
